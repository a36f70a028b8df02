//! The backend-neutral operand checks: every thunk of real compiled
//! schedules passes, and each kind of lie a schedule can tell (an extent
//! past its buffer, a huge stride, a write to a weight, an output that
//! overlaps a matmul input) is refused with a message naming the operand.

mod common;

use common::*;
use rlx_compile::operands::{check_operands, extent, operands};
use rlx_compile::{compile, BufRef, CompileOptions, Space, Thunk};
use rlx_ir::{Activation, BinaryOp, DType};

fn arena(offset: u64, bytes: u64) -> BufRef {
    BufRef { space: Space::Arena, offset, bytes }
}

#[test]
fn extent_is_the_last_index_plus_one_and_saturates() {
    // A [2, 3] view with row stride 5: last element at 1*5 + 2 = 7.
    assert_eq!(extent(&[2, 3], &[5, 1]), 8);
    assert_eq!(extent(&[4, 0, 3], &[9, 9, 1]), 0);
    assert_eq!(extent(&[3], &[u64::MAX]), u64::MAX);
}

#[test]
fn every_thunk_of_compiled_layers_passes() {
    for fuse in [false, true] {
        for precision in [None, Some(DType::F16)] {
            let c =
                compile(&bert_layer(true), &CompileOptions { precision, fuse, merge_matmuls: fuse, ..CompileOptions::default() }).unwrap();
            for (i, t) in c.schedule.thunks.iter().enumerate() {
                assert_eq!(check_operands(t), Ok(()), "thunk {i} ({})\n{}", t.kind(), c.schedule);
                assert!(!operands(t).is_empty());
            }
        }
    }
}

#[test]
fn a_strided_read_past_its_buffer_is_refused() {
    // 2 × 3 elements read with a row stride of 4: 7 f32 = 28 bytes needed.
    let t = |a_bytes| Thunk::Binary {
        op: BinaryOp::Add,
        dtype: DType::F32,
        out_shape: vec![2, 3],
        a: arena(0, a_bytes),
        a_strides: vec![4, 1],
        b: arena(64, 24),
        b_strides: vec![3, 1],
        out: arena(128, 24),
    };
    assert_eq!(check_operands(&t(28)), Ok(()));
    let e = check_operands(&t(27)).unwrap_err();
    assert!(e.contains("operand a") && e.contains("28") && e.contains("27"), "{e}");
}

#[test]
fn huge_strides_and_writes_to_weights_are_refused() {
    let copy = Thunk::Copy {
        dtype: DType::F32,
        shape: vec![3, 2],
        src: arena(0, 1 << 20),
        src_strides: vec![u64::MAX / 2, 1],
        dst: arena(1 << 20, 24),
        dst_strides: vec![2, 1],
    };
    assert!(check_operands(&copy).unwrap_err().contains("operand src"));
    let act = Thunk::Activation {
        act: Activation::Relu,
        dtype: DType::F32,
        n: 8,
        x: arena(0, 32),
        out: BufRef { space: Space::Weight(0), offset: 0, bytes: 32 },
    };
    assert!(check_operands(&act).unwrap_err().contains("read-only"));
}

#[test]
fn a_matmul_output_overlapping_its_input_is_refused() {
    let c = compile(&bert_layer(true), &CompileOptions::default()).unwrap();
    let Some(Thunk::MatMul(mm)) = c.schedule.thunks.iter().find(|t| matches!(t, Thunk::MatMul(_))).cloned() else {
        panic!("no matmul in\n{}", c.schedule)
    };
    let mut bad = mm.clone();
    bad.out = BufRef { offset: mm.a.offset + 4, ..mm.out };
    bad.out.space = mm.a.space;
    let e = check_operands(&Thunk::MatMul(bad)).unwrap_err();
    assert!(e.contains("overlaps"), "{e}");
}

#[test]
fn misaligned_operands_and_short_stride_lists_are_refused() {
    let act = |x_off| Thunk::Activation { act: Activation::Relu, dtype: DType::F32, n: 4, x: arena(x_off, 16), out: arena(64, 16) };
    assert_eq!(check_operands(&act(32)), Ok(()));
    assert!(check_operands(&act(34)).unwrap_err().contains("not a multiple"));
    // Two dims, one stride: the extent would only see the first dim.
    let t = Thunk::Binary {
        op: BinaryOp::Mul,
        dtype: DType::F32,
        out_shape: vec![2, 3],
        a: arena(0, 24),
        a_strides: vec![3],
        b: arena(32, 24),
        b_strides: vec![3, 1],
        out: arena(64, 24),
    };
    assert!(check_operands(&t).unwrap_err().contains("strides"));
}
