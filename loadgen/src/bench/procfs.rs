//! What the phases read of a process from `/proc`: its CPU time (its own, and its exited
//! children's), its parent, its peak RSS; and what the soak samples ([`resources`]): its RSS,
//! open descriptors and threads. Linux only, as the bench and the soak are.

/// Linux's clock ticks a second (`getconf CLK_TCK`), the unit of `/proc/<pid>/stat`'s times.
pub(super) const TICKS: f64 = 100.0;

/// The fields of `/proc/<pid>/stat` the phases use, times in seconds.
pub(super) struct Stat {
    pub(super) ppid: u32,
    /// `utime + stime`.
    pub(super) cpu_s: f64,
    /// `cutime + cstime`: the children it has waited for.
    pub(super) children_cpu_s: f64,
}

pub(super) fn stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces): ppid is field 4, utime 14, stime 15,
    // cutime 16, cstime 17.
    let f: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    Some(Stat {
        ppid: f.get(1)?.parse().ok()?,
        cpu_s: (n(11)? + n(12)?) / TICKS,
        children_cpu_s: (n(13)? + n(14)?) / TICKS,
    })
}

/// The pids of every process now.
pub(super) fn pids() -> impl Iterator<Item = u32> {
    (std::fs::read_dir("/proc").into_iter().flatten())
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
}

/// A `kB` field of `/proc/<pid>/status` (`VmHWM:`, `VmRSS:`) in MB, or a count (`Threads:`).
fn status_field(status: &str, name: &str) -> Option<f64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// A process's (peak RSS in MB, CPU seconds) so far; zeros once it is gone.
pub(super) fn usage(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm_kb = status_field(&status, "VmHWM:").unwrap_or(0.0);
    (hwm_kb / 1024.0, stat(pid).map_or(0.0, |s| s.cpu_s))
}

/// What a running process holds now: RSS in MB, open file descriptors, threads (None: gone).
pub(crate) fn resources(pid: u32) -> Option<(f64, u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_mb = status_field(&status, "VmRSS:")? / 1024.0;
    let threads = status_field(&status, "Threads:")? as u64;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss_mb, fds, threads))
}
