//! (cgroups: being written)
