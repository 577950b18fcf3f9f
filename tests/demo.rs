//! The README's main-job command, with small numbers, so that the demo cannot rot: it must finish
//! with nothing lost, nothing from rolled-back payments, and the injected duplicate recognised.

use std::process::Command;

#[test]
fn payments_demo_runs_clean() {
    let root = env!("CARGO_MANIFEST_DIR");
    // Its own directory (also the socket directory): another checkout's suite may run at the same time.
    let dir = format!("/tmp/opg-demo-test-{}", std::process::id());
    let output = Command::new("bash")
        .arg(format!("{root}/scripts/demo.sh"))
        .env("DEMO_PAYMENTS", "200")
        .env("DEMO_SKIP_INSTALL", "1")
        .env("DEMO_DIR", &dir)
        .output()
        .expect("bash scripts/demo.sh");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("events lost                           0"), "{stdout}");
    assert!(stdout.contains("events from rolled-back txns          0"), "{stdout}");
    assert!(stdout.contains("OK: nothing lost"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}
