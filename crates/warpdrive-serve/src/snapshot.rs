//! What every thread of this process is doing right now, from `/proc/self/task` (Linux; an
//! empty snapshot elsewhere): taken by the stall probes while a runtime is stalled, it names
//! the kernel function each thread sleeps in (`wchan`: a futex of a lock, `epoll_wait`, a page
//! fault's compaction) and its system call — what a stall's time is spent on, which the
//! stall's length alone cannot say.

/// One entry per thread: `name/tid state wchan sys cpu flt run wait`, e.g.
/// `warpdrive-load/4242 S futex_wait_queue sys=202:0x7f3a0c001d40 cpu=3 flt=2811/0 run=81234
/// wait=912`. `state` is the kernel's letter (R running or waiting for a CPU, S sleeping, D
/// uninterruptible: I/O or a page fault), `sys` the system call the thread is blocked in and
/// its first argument (`running` when it is not in one), `cpu` the processor it last ran on,
/// `flt` its minor/major page faults so far, `run` and `wait` its total µs on a CPU and
/// waiting for one (`schedstat`): two snapshots apart tell a thread that ran (a long poll)
/// from one that was runnable but not run, and one that faulted in fresh memory.
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
            let Stat {
                name,
                state,
                cpu,
                faults,
            } = read("stat")
                .ok()
                .map_or_else(Stat::unknown, |s| stat_fields(&s));
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
                "{name}/{tid} {state} {wchan} sys={sys} cpu={cpu} flt={faults} run={} wait={}",
                us(0),
                us(1)
            ));
        }
    }
    out
}

/// What a thread's `/proc/.../stat` line says.
#[derive(Debug, PartialEq)]
struct Stat {
    name: String,
    /// The kernel's state letter.
    state: String,
    /// The processor it last ran on.
    cpu: String,
    /// Its minor and major page faults so far, `minor/major`: two snapshots apart tell a
    /// thread faulting in fresh memory (a heap grown past its high-water mark).
    faults: String,
}

impl Stat {
    fn unknown() -> Stat {
        Stat {
            name: "?".into(),
            state: "?".into(),
            cpu: "?".into(),
            faults: "?/?".into(),
        }
    }
}

/// The fields of a `/proc/.../stat` line [`Stat`] keeps: the name is in parentheses and may
/// hold spaces, so the fields after it are counted from its `)`.
fn stat_fields(stat: &str) -> Stat {
    let open = stat.find('(');
    let close = stat.rfind(')');
    let (name, rest) = match (open, close) {
        (Some(o), Some(c)) if c > o => (&stat[o + 1..c], &stat[c + 1..]),
        _ => ("?", stat),
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the line, minor faults 10, major faults 12,
    // processor 39.
    let field = |n: usize| fields.get(n - 3).copied().unwrap_or("?").to_string();
    Stat {
        name: name.to_string(),
        state: field(3),
        cpu: field(39),
        faults: format!("{}/{}", field(10), field(12)),
    }
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
            Stat {
                name: "tokio w".into(),
                state: "S".into(),
                cpu: "7".into(),
                faults: "10/12".into(),
            }
        );
        assert_eq!(
            stat_fields(""),
            Stat {
                name: "?".into(),
                state: "?".into(),
                cpu: "?".into(),
                faults: "?/?".into(),
            }
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_snapshot_names_this_thread() {
        let name = std::thread::current().name().map(str::to_string);
        let s = threads();
        assert!(s.contains("sys=") && s.contains(" flt="), "{s}");
        // The test harness names its threads after the test (cut to 15 bytes by the kernel).
        if let Some(n) = name {
            let cut: String = n.chars().take(15).collect();
            assert!(s.contains(&cut), "{s} lacks {cut}");
        }
    }
}
