//! Identifiers and quantities as newtypes, parsed once at the boundary.
//!
//! Quantities are integers in the unit their name carries, so that arithmetic in
//! the core is exact and comparisons never depend on floating-point rounding.

use std::fmt;

macro_rules! newtype {
    ($(#[$m:meta])* $name:ident($inner:ty), $unit:literal) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}{}", self.0, $unit)
            }
        }
    };
}

newtype!(
    /// A node's position in the cluster's node list; stable for the life of a [`crate::Cluster`].
    NodeId(u32), ""
);
newtype!(
    /// A job, as numbered by whoever submits it.
    JobId(u64), ""
);
newtype!(
    /// CPU in thousandths of a core.
    CpuMilli(u64), "m"
);
newtype!(
    /// Memory in mebibytes (host memory or GPU memory, by context).
    MemMib(u64), "Mi"
);
newtype!(
    /// A share of one GPU's compute in thousandths: 1000 is the whole GPU.
    GpuMilli(u32), "mGPU"
);

impl GpuMilli {
    /// A whole GPU.
    pub const WHOLE: GpuMilli = GpuMilli(1000);
}

/// Where a task sits inside its job: the task group and the replica index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskId {
    pub job: JobId,
    pub group: u16,
    pub index: u32,
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.job.0, self.group, self.index)
    }
}
