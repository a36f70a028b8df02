//! The README's "Using RLX from Rust" example, kept compiling by `cargo test`.

use rlx::{DType, Device, Graph, Session, Tensor};

fn main() -> Result<(), rlx::Error> {
    // Build a graph: y = gelu(x · w + b)
    let mut g = Graph::new();
    let x = g.input("x", [2, 3], DType::F32)?;
    let w = g.param("w", [3, 4], DType::F32)?;
    let b = g.param("b", [4], DType::F32)?;
    let y = g.linear(x, w, Some(b), false)?;
    let y = g.gelu(y)?;
    g.output(y)?;

    // Weights live in the session's store, shared by everything compiled from it.
    let session = Session::new(Device::Cpu)?; // or Device::Cuda(0)
    session.set_weight("w", Tensor::from_f32([3, 4], &[0.1; 12])?)?;
    session.set_weight("b", Tensor::from_f32([4], &[0.0, 0.5, 1.0, 1.5])?)?;

    let mut exe = session.compile(&g)?; // passes, arena plan, schedule, backend prepare
    let out = exe.run(&[("x", &Tensor::from_f32([2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?)])?;
    println!("{:?}", out[0].to_f32());
    Ok(())
}
