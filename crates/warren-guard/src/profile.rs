//! (profile: being written)
