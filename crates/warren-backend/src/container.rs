//! (container driver: being written)
