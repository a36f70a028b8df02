use serde::{Deserialize, Serialize};
use std::fmt;

use crate::IrError;

/// A tensor shape (row-major). Rank 0 is a scalar with one element.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1usize; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }
    pub fn last(&self) -> usize {
        self.0.last().copied().unwrap_or(1)
    }

    /// When `self` is leading 1s and then the trailing dims of `of` (last
    /// dim included), row r of `of` (rows of its last dim) lines up with
    /// row r % R of `self`: returns R, the rows of `self`. None otherwise.
    pub fn row_period(&self, of: &Shape) -> Option<usize> {
        let first = self.0.iter().position(|&d| d != 1).unwrap_or(self.0.len());
        let tail = &self.0[first..];
        if self.0.is_empty() || tail.len() > of.0.len() || !of.0.ends_with(tail) || self.last() != of.last() {
            return None;
        }
        Some(self.numel() / self.last().max(1))
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

/// NumPy broadcasting of two shapes.
pub fn broadcast_shapes(op: &str, a: &Shape, b: &Shape) -> Result<Shape, IrError> {
    let r = a.rank().max(b.rank());
    let mut out = vec![0; r];
    for (i, o) in out.iter_mut().enumerate() {
        let da = if i + a.rank() >= r { a.0[i + a.rank() - r] } else { 1 };
        let db = if i + b.rank() >= r { b.0[i + b.rank() - r] } else { 1 };
        *o = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(IrError::shape(op, format!("cannot broadcast {a} with {b}")));
        };
    }
    Ok(Shape(out))
}
