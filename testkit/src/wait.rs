//! Waiting for a condition against a deadline: the only way servers and tests wait here.

use std::time::{Duration, Instant};

/// How long a wait may take before the caller fails: long enough for a loaded 2-core machine
/// running several suites at once, short enough that a hung test ends.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `probe` until it returns `Some`, failing with `what` after `timeout`. The pause between
/// polls grows from 2 ms to 100 ms: quick conditions are seen at once, slow ones are not polled
/// hard.
pub fn wait_for<T>(timeout: Duration, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(2);
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}
