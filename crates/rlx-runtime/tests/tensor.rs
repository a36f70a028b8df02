//! Tensor conversions: ids narrowed from i64 saturate instead of wrapping,
//! widening is exact, floats round through each storage type.

use rlx_ir::DType;
use rlx_runtime::Tensor;

#[test]
fn i64_to_i32_saturates_instead_of_wrapping() {
    let big = i32::MAX as i64 + 5; // would wrap to a negative, valid-looking id
    let t = Tensor::from_i64(vec![4], &[7, -3, big, i64::MIN]).unwrap_or_else(|e| panic!("{e}"));
    let n = t.to_dtype(DType::I32).as_i32().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(n, vec![7, -3, i32::MAX, i32::MIN]);
    let back = Tensor::from_i32(vec![2], &[i32::MIN, 12345]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back.to_dtype(DType::I64).as_i64().unwrap_or_else(|e| panic!("{e}")), vec![i32::MIN as i64, 12345]);
}

#[test]
fn floats_round_through_half_types() {
    let v = [1.0f32, -2.5, 0.1, 65504.0];
    let t = Tensor::from_f32(vec![4], &v).unwrap_or_else(|e| panic!("{e}"));
    for dt in [DType::F16, DType::BF16] {
        let r = t.to_dtype(dt).to_f32();
        for (a, b) in v.iter().zip(&r) {
            assert!((a - b).abs() <= a.abs() * 4e-3, "{dt}: {a} -> {b}");
        }
    }
}
