use crate::error::{ImageError, Result};

const MAX_NAME_BYTES: usize = 128;

/// Checks `name` against `[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}`. Names become
/// file names, so this is also what keeps a name from leaving `manifests/`.
pub fn validate_name(name: &str) -> Result<()> {
    let bytes = name.as_bytes();
    let first_ok = bytes.first().is_some_and(u8::is_ascii_alphanumeric);
    let rest_ok = bytes.iter().skip(1).all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if first_ok && rest_ok && bytes.len() <= MAX_NAME_BYTES {
        Ok(())
    } else {
        Err(ImageError::InvalidName(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_names_in_the_grammar() {
        for name in ["a", "0", "A.b_c-9", "debian-12.slim", &"x".repeat(128)] {
            assert!(validate_name(name).is_ok(), "{name:?} rejected");
        }
    }

    #[test]
    fn rejects_names_outside_the_grammar() {
        let long = "x".repeat(129);
        for name in ["", ".", "..", ".hidden", "-x", "_x", "a/b", "a b", "a\0b", "é", "a\n", &long] {
            assert!(matches!(validate_name(name), Err(ImageError::InvalidName(_))), "{name:?} accepted");
        }
    }
}
