//! Bad input through the public API: every case is an Err that names the
//! thing, never a panic, and the executable stays usable.

use rlx::{DType, Device, Graph, Session, Tensor};

fn linear_graph() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", [2, 3], DType::F32).unwrap();
    let w = g.param("w", [3, 4], DType::F32).unwrap();
    let y = g.matmul(x, w).unwrap();
    g.output(y).unwrap();
    g
}

fn session() -> Session {
    let s = Session::new(Device::Cpu).unwrap();
    s.set_weight("w", Tensor::from_f32([3, 4], &[0.5; 12]).unwrap()).unwrap();
    s
}

#[test]
fn wrong_inputs_are_named() {
    let s = session();
    let mut exe = s.compile(&linear_graph()).unwrap();
    let good = Tensor::from_f32([2, 3], &[1.0; 6]).unwrap();
    type Case<'a> = (Vec<(&'a str, Tensor)>, &'a [&'a str]);
    let cases: Vec<Case> = vec![
        (vec![("y", good.clone())], &["'y'", "not an input"]),
        (vec![], &["'x'", "missing"]),
        (vec![("x", Tensor::from_f32([3, 2], &[1.0; 6]).unwrap())], &["'x'", "[2, 3]", "[3, 2]"]),
        (vec![("x", Tensor::from_i32([2, 3], &[1; 6]).unwrap())], &["'x'", "f32", "i32"]),
        (vec![("x", good.clone()), ("x", good.clone())], &["'x'", "more than once"]),
    ];
    for (inputs, needles) in cases {
        let ins: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (*n, t)).collect();
        let err = exe.run(&ins).unwrap_err().to_string();
        for n in needles {
            assert!(err.contains(n), "error '{err}' should mention {n}");
        }
    }
    // Still usable.
    let out = exe.run(&[("x", &good)]).unwrap();
    assert_eq!(out[0].to_f32(), vec![1.5; 8]);
}

#[test]
fn missing_and_misshaped_params() {
    let s = Session::new(Device::Cpu).unwrap();
    let err = s.compile(&linear_graph()).err().expect("missing param must fail").to_string();
    assert!(err.contains("'w'") && err.contains("missing"), "{err}");

    s.set_weight("w", Tensor::from_f32([4, 3], &[0.5; 12]).unwrap()).unwrap();
    let err = s.compile(&linear_graph()).err().expect("mis-shaped param must fail").to_string();
    assert!(err.contains("[3, 4]") && err.contains("[4, 3]"), "{err}");

    // Data of the wrong length never becomes a tensor.
    let err = Tensor::from_f32([3, 4], &[0.5; 11]).unwrap_err().to_string();
    assert!(err.contains("44") && err.contains("48"), "{err}");
    // Updating a param with another shape is refused.
    let err = s.set_weight("w", Tensor::from_f32([2, 6], &[0.5; 12]).unwrap()).unwrap_err().to_string();
    assert!(err.contains("'w'"), "{err}");
}

#[test]
fn invalid_graphs_are_refused() {
    let s = session();
    let mut g = linear_graph();
    g.nodes[2].shape = rlx::Shape::new([2, 5]);
    let err = s.compile(&g).err().expect("invalid graph must fail").to_string();
    assert!(err.contains("node 2") && err.contains("matmul"), "{err}");
    let mut g = linear_graph();
    g.outputs.clear();
    assert!(s.compile(&g).is_err());
}

#[test]
fn weight_update_after_compile_is_seen() {
    let s = session();
    let mut exe = s.compile(&linear_graph()).unwrap();
    let x = Tensor::from_f32([2, 3], &[1.0; 6]).unwrap();
    assert_eq!(exe.run(&[("x", &x)]).unwrap()[0].to_f32(), vec![1.5; 8]);
    s.set_weight("w", Tensor::from_f32([3, 4], &[1.0; 12]).unwrap()).unwrap();
    assert_eq!(exe.run(&[("x", &x)]).unwrap()[0].to_f32(), vec![3.0; 8]);
}

#[test]
fn cuda_device_errors_cleanly_without_gpu() {
    // On a machine without a GPU (CI) this must be an error, not a panic; on
    // a GPU machine it succeeds.
    match Session::new(Device::Cuda(0)) {
        Ok(_) => eprintln!("CUDA present: session created"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("cuda"), "{msg}");
        }
    }
    let err = Session::new(Device::Cuda(97)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("97") || err.contains("cuda"), "{err}");
}
