//! (file operations: being written)
