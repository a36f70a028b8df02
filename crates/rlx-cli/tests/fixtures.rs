//! Fixtures other crates' tests read are what the current code makes.
//! rlx-cuda's FFN-fusion test reads a compiled MiniLM schedule
//! (crates/rlx-cuda/tests/data/minilm-f16-1x128.schedule.json); this test
//! compiles it again with `rlx inspect` and fails on any difference, naming
//! the command that regenerates the file.

mod common;

use common::{model_dir, path_str, rlx, stderr};

#[test]
fn the_minilm_schedule_fixture_is_current() {
    let Some(dir) = model_dir("the_minilm_schedule_fixture_is_current") else { return };
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../rlx-cuda/tests/data/minilm-f16-1x128.schedule.json");
    let o = rlx(&["inspect", "--model", path_str(&dir), "--precision", "f16", "--batch", "1", "--seq", "128", "--json"]);
    assert!(o.status.success(), "rlx inspect failed: {}", stderr(&o));
    let made: serde_json::Value = serde_json::from_slice(&o.stdout).expect("rlx inspect --json prints JSON");
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&fixture).expect("fixture")).expect("fixture JSON");
    assert!(
        made == kept,
        "{} is not what the compiler makes now; regenerate it with\n  rlx inspect --model models/all-MiniLM-L6-v2 --precision f16 --batch 1 --seq 128 --json | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin), separators=(\",\", \":\")))' > {}",
        fixture.display(),
        fixture.display()
    );
}
