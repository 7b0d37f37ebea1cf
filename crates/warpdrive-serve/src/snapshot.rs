//! What every thread of this process is doing right now, from `/proc/self/task` (Linux; an
//! empty snapshot elsewhere): taken by the stall probes while a runtime is stalled, it names
//! the kernel function each thread sleeps in (`wchan`: a futex of a lock, `epoll_wait`, a page
//! fault's compaction) and its system call — what a stall's time is spent on, which the
//! stall's length alone cannot say.

/// One entry per thread: `name/tid state wchan sys cpu run wait`, e.g.
/// `warpdrive-load/4242 S futex_wait_queue sys=202:0x7f3a0c001d40 cpu=3 run=81234 wait=912`.
/// `state` is the kernel's letter (R running or waiting for a CPU, S sleeping, D
/// uninterruptible: I/O or a page fault), `sys` the system call the thread is blocked in and
/// its first argument (`running` when it is not in one), `cpu` the processor it last ran on,
/// `run` and `wait` its total µs on a CPU and waiting for one (`schedstat`): two snapshots
/// apart tell a thread that ran (a long poll) from one that was runnable but not run.
pub fn threads() -> String {
    let mut out = String::new();
    #[cfg(target_os = "linux")]
    {
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return out;
        };
        let mut tids: Vec<u32> = dir
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        tids.sort_unstable();
        for tid in tids {
            let read = |f: &str| std::fs::read_to_string(format!("/proc/self/task/{tid}/{f}"));
            let (name, state, cpu) = read("stat").ok().map_or_else(
                || ("?".to_string(), "?".to_string(), "?".to_string()),
                |s| stat_fields(&s),
            );
            let wchan = read("wchan")
                .ok()
                .filter(|w| !w.is_empty() && w != "0")
                .unwrap_or_else(|| "-".into());
            // The call and its first argument: for a futex (202 on x86-64) the word waited
            // on, the same for every thread queued on one lock, apart for parked workers.
            let sys = read("syscall")
                .ok()
                .map(|s| s.split_whitespace().take(2).collect::<Vec<_>>().join(":"))
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "?".into());
            let sched: Vec<u64> = read("schedstat")
                .ok()
                .map(|s| {
                    s.split_whitespace()
                        .filter_map(|f| f.parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            let us = |i: usize| {
                sched
                    .get(i)
                    .map_or("?".into(), |ns| (ns / 1000).to_string())
            };
            if !out.is_empty() {
                out.push_str("; ");
            }
            out.push_str(&format!(
                "{name}/{tid} {state} {wchan} sys={sys} cpu={cpu} run={} wait={}",
                us(0),
                us(1)
            ));
        }
    }
    out
}

/// The name, state letter and last processor of a `/proc/.../stat` line: the name is in
/// parentheses and may hold spaces, so the fields after it are counted from its `)`.
fn stat_fields(stat: &str) -> (String, String, String) {
    let open = stat.find('(');
    let close = stat.rfind(')');
    let (name, rest) = match (open, close) {
        (Some(o), Some(c)) if c > o => (&stat[o + 1..c], &stat[c + 1..]),
        _ => ("?", stat),
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the line, processor field 39.
    let state = fields.first().copied().unwrap_or("?");
    let cpu = fields.get(36).copied().unwrap_or("?");
    (name.to_string(), state.to_string(), cpu.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_count_past_a_name_with_spaces() {
        let mut line = String::from("4242 (tokio w) S");
        // Fields 4 to 38, then the processor (39).
        for i in 4..=38 {
            line.push_str(&format!(" {i}"));
        }
        line.push_str(" 7 0 0");
        assert_eq!(
            stat_fields(&line),
            ("tokio w".to_string(), "S".to_string(), "7".to_string())
        );
        assert_eq!(stat_fields(""), ("?".into(), "?".into(), "?".into()));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_snapshot_names_this_thread() {
        let name = std::thread::current().name().map(str::to_string);
        let s = threads();
        assert!(s.contains("sys="), "{s}");
        // The test harness names its threads after the test (cut to 15 bytes by the kernel).
        if let Some(n) = name {
            let cut: String = n.chars().take(15).collect();
            assert!(s.contains(&cut), "{s} lacks {cut}");
        }
    }
}
