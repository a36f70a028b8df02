//! Where the compiler and the backends meet: a [`Schedule`] is a list of
//! [`Thunk`]s over byte offsets in a few memory spaces (the activation
//! arena, weights, state, constants), plus the tensors it reads and writes.
//! `rlx-compile` produces it; the backends (`rlx-cpu`, `rlx-cuda`) run it and
//! depend only on this crate, never on the compiler. [`operands`] says what
//! every thunk touches, so a backend can check a schedule before it runs.

pub mod operands;
mod print;
mod schedule;

pub use schedule::*;
