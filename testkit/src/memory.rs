//! A process's private memory, for the tests and the bench that hold the relay to a bound
//! whatever one transaction enqueues.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The private resident memory of process `pid`, in kB (RssAnon: not the shared buffers it reads
/// the log through, which VmRSS counts too); 0 when the process is gone.
pub fn rss_kb(pid: i32) -> u64 {
    status_kb(pid, "RssAnon:")
}

/// The address space of process `pid` (`VmSize`), in kB, which `prlimit --as` bounds; 0 when the
/// process is gone.
pub fn vm_size_kb(pid: i32) -> u64 {
    status_kb(pid, "VmSize:")
}

/// A `kB` field of `/proc/<pid>/status`.
fn status_kb(pid: i32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Samples a process's private memory every 20 ms until dropped; `peak_kb` is the largest sample.
pub struct PeakMemory {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl PeakMemory {
    pub fn watch(pid: i32) -> PeakMemory {
        let (peak, stop) = (Arc::new(AtomicU64::new(rss_kb(pid))), Arc::new(AtomicBool::new(false)));
        let (p, s) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                p.fetch_max(rss_kb(pid), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        PeakMemory { peak, stop }
    }

    pub fn peak_kb(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }
}

impl Drop for PeakMemory {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}
