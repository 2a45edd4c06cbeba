//! A small, seeded random source for placement sampling (no statistics
//! rides on it; only spread).

use std::sync::Mutex;

pub(crate) struct Rng(Mutex<u64>);

impl Rng {
    pub(crate) fn new() -> Rng {
        let mut seed = [0u8; 8];
        // Any seed will do: a failed read (a kernel without its pool yet)
        // falls back to the clock.
        if rustix::rand::getrandom(&mut seed, rustix::rand::GetRandomFlags::empty()).is_err() {
            seed = (warren_node::now_ms() | 1).to_le_bytes();
        }
        Rng(Mutex::new(u64::from_le_bytes(seed) | 1))
    }

    /// A number in `0..n` (`n > 0`).
    pub(crate) fn below(&self, n: usize) -> usize {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // xorshift64*
        let mut x = *state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        *state = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1) as u64) as usize
    }
}
