//! Printing results to stdout. A reader that goes away early (`rlx inspect |
//! head`) ends the command quietly; `println!` would panic on the broken pipe.

use std::io::{ErrorKind, Write};

/// Writes `text` and a newline to stdout.
pub fn print(text: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.write_all(b"\n")).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(format!("writing to stdout: {e}")),
    }
}
