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

/// Whether stdout is a pipe or socket whose reader has gone away, asked
/// without writing: long work can stop as soon as nobody waits for it,
/// instead of at its first write. False for files and terminals (a full
/// disk shows only when written to).
pub fn reader_gone() -> bool {
    let mut fd = libc::pollfd { fd: libc::STDOUT_FILENO, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n > 0 && fd.revents & (libc::POLLERR | libc::POLLHUP) != 0
}
