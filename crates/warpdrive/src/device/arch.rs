//! GPU architectures, as compute capability and as the target name a compiler takes.

use std::fmt;

/// A GPU architecture NVRTC compiles for: `sm_{major}{minor}`, with `a` for the
/// architecture-specific target (`sm_90a`: `wgmma`, `setmaxnreg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
    pub specific: bool,
}

impl Arch {
    /// Hopper's architecture-specific target (`wgmma`).
    pub const SM_90A: Arch = Arch {
        major: 9,
        minor: 0,
        specific: true,
    };

    /// The target for a device of this compute capability: `sm_90a` on Hopper (so its own
    /// instructions are available), `sm_XY` elsewhere.
    pub fn from_compute_capability(major: u32, minor: u32) -> Arch {
        Arch {
            major,
            minor,
            specific: (major, minor) == (9, 0),
        }
    }

    /// Parses `sm_90a`, `sm_80`, ...
    pub fn parse(s: &str) -> Option<Arch> {
        let digits = s.strip_prefix("sm_")?;
        let (digits, specific) = match digits.strip_suffix('a') {
            Some(d) => (d, true),
            None => (digits, false),
        };
        if digits.len() < 2 || !digits.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Some(Arch {
            major: major.parse().ok()?,
            minor: minor.parse().ok()?,
            specific,
        })
    }

    pub fn name(&self) -> String {
        format!(
            "sm_{}{}{}",
            self.major,
            self.minor,
            if self.specific { "a" } else { "" }
        )
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}
