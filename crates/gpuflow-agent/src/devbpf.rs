//! GPU device control on cgroup v2: an eBPF program of type
//! `BPF_PROG_TYPE_CGROUP_DEVICE` attached to a task's group, which the
//! kernel asks before the task (or any process in the group) opens or
//! makes a device node. It refuses NVIDIA's GPU device nodes (`c 195:N`,
//! N < 254) other than the task's own, and allows everything else (the
//! control devices `nvidiactl` and `nvidia-modeset`, `nvidia-uvm`,
//! `/dev/null`, …), as the v1 `devices` deny list does.
//!
//! The program is a handful of instructions written here (as runc
//! does), loaded and attached with the `bpf` system call; no compiler or
//! library is needed on the node.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use crate::migcaps::CapsRule;

/// One eBPF instruction (`struct bpf_insn`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Insn {
    code: u8,
    /// dst in the low nibble, src in the high one.
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | dst,
        off,
        imm,
    }
}

// Opcodes (linux/bpf_common.h, linux/bpf.h).
const LDX_MEM_W: u8 = 0x61;
const ALU64_AND_K: u8 = 0x57;
const ALU64_MOV_K: u8 = 0xb7;
const JMP_JEQ_K: u8 = 0x15;
const JMP_JNE_K: u8 = 0x55;
const JMP_JGT_K: u8 = 0x25;
const JMP_EXIT: u8 = 0x95;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const BPF_F_ALLOW_MULTI: u32 = 2;
/// `BPF_DEVCG_DEV_CHAR`: the low 16 bits of `access_type`.
const DEV_CHAR: i32 = 2;

/// The program: 1 (allow) unless the device is a character device of
/// `major` with a minor below 254 that is not in `allowed`, or one of
/// `caps`'s major (MIG capabilities) with a minor not in its allowed list.
fn program(major: u32, allowed: &[u32], caps: Option<&CapsRule>) -> Vec<Insn> {
    // r1: struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }
    let mut p = vec![
        insn(LDX_MEM_W, 2, 1, 0, 0),        // r2 = access_type
        insn(ALU64_AND_K, 2, 0, 0, 0xffff), // r2 = its device type
        insn(LDX_MEM_W, 3, 1, 4, 0),        // r3 = major
        insn(LDX_MEM_W, 4, 1, 8, 0),        // r4 = minor
    ];
    // Jumps to "allow" and to the capabilities' section, counted from the
    // instruction after each; filled in once their places are known.
    let mut to_allow = Vec::new();
    let mut to_caps = None;
    to_allow.push(p.len());
    p.push(insn(JMP_JNE_K, 2, 0, 0, DEV_CHAR));
    if let Some(c) = caps {
        to_caps = Some(p.len());
        p.push(insn(JMP_JEQ_K, 3, 0, 0, c.major as i32));
    }
    to_allow.push(p.len());
    p.push(insn(JMP_JNE_K, 3, 0, 0, major as i32));
    to_allow.push(p.len());
    p.push(insn(JMP_JGT_K, 4, 0, 0, 253));
    for &m in allowed {
        to_allow.push(p.len());
        p.push(insn(JMP_JEQ_K, 4, 0, 0, m as i32));
    }
    p.push(insn(ALU64_MOV_K, 0, 0, 0, 0)); // deny
    p.push(insn(JMP_EXIT, 0, 0, 0, 0));
    if let (Some(c), Some(at)) = (caps, to_caps) {
        p[at].off = (p.len() - at - 1) as i16;
        for &m in &c.allowed {
            to_allow.push(p.len());
            p.push(insn(JMP_JEQ_K, 4, 0, 0, m as i32));
        }
        p.push(insn(ALU64_MOV_K, 0, 0, 0, 0)); // deny
        p.push(insn(JMP_EXIT, 0, 0, 0, 0));
    }
    let allow = p.len();
    p.push(insn(ALU64_MOV_K, 0, 0, 0, 1)); // allow
    p.push(insn(JMP_EXIT, 0, 0, 0, 0));
    for at in to_allow {
        p[at].off = (allow - at - 1) as i16;
    }
    p
}

fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a zeroed `union bpf_attr` of 128 bytes with the
    // command's fields set; the kernel reads (and for loads writes) it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr),
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Attaches to the cgroup v2 directory `dir` a program that denies the
/// GPU device nodes of [`NVIDIA_MAJOR`](crate::cgroup::NVIDIA_MAJOR) but
/// `allowed`'s minors, and the MIG capabilities but `caps`'s allowed ones.
///
/// # Errors
/// When the program cannot be loaded or attached (no `CONFIG_CGROUP_BPF`,
/// the agent lacks `CAP_BPF`/`CAP_SYS_ADMIN`), or `dir` cannot be opened.
pub fn deny_gpus(dir: &Path, allowed: &[u32], caps: Option<&CapsRule>) -> Result<(), String> {
    let prog_fd = load(allowed, caps)?;
    let group = std::fs::File::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut attr = [0u64; 16];
    // target_fd, attach_bpf_fd | attach_type, attach_flags
    attr[0] = u64::from(group.as_raw_fd() as u32) | (u64::from(prog_fd.as_raw_fd() as u32) << 32);
    attr[1] = u64::from(BPF_CGROUP_DEVICE) | (u64::from(BPF_F_ALLOW_MULTI) << 32);
    bpf(BPF_PROG_ATTACH, &mut attr)
        .map_err(|e| format!("cannot attach the device program to {}: {e}", dir.display()))?;
    Ok(())
}

/// Whether this node can load the program (checked once at start).
///
/// # Errors
/// Why not, in words.
pub fn probe() -> Result<(), String> {
    load(&[], None).map(drop)
}

fn load(allowed: &[u32], caps: Option<&CapsRule>) -> Result<OwnedFd, String> {
    let prog = program(crate::cgroup::NVIDIA_MAJOR, allowed, caps);
    let license = c"Apache-2.0";
    let mut attr = [0u64; 16];
    // prog_type, insn_cnt | insns | license | log_level, log_size | log_buf …
    attr[0] = u64::from(BPF_PROG_TYPE_CGROUP_DEVICE) | ((prog.len() as u64) << 32);
    attr[1] = prog.as_ptr() as u64;
    attr[2] = license.as_ptr() as u64;
    let fd = bpf(BPF_PROG_LOAD, &mut attr)
        .map_err(|e| format!("cannot load the device program (bpf): {e}"))?;
    // SAFETY: the kernel returned a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jumps_land_on_allow() {
        let p = program(195, &[1, 3], None);
        // 4 loads, 3 screens, 2 allowed minors, deny (2), allow (2).
        assert_eq!(p.len(), 13);
        let allow = 11;
        for (i, ins) in p.iter().enumerate() {
            if matches!(ins.code, JMP_JEQ_K | JMP_JNE_K | JMP_JGT_K) {
                assert_eq!(i + 1 + ins.off as usize, allow, "{i}");
            }
        }
        assert_eq!((p[allow].code, p[allow].imm), (ALU64_MOV_K, 1));
    }

    /// Runs the program on a device, as the kernel would (the few
    /// instructions it uses).
    fn verdict(p: &[Insn], ty: u32, major: u32, minor: u32) -> i64 {
        let ctx = [ty | (3 << 16), major, minor]; // access: read | write
        let mut r = [0i64; 5];
        let mut pc = 0usize;
        loop {
            let i = p[pc];
            let (dst, src) = ((i.regs & 0xf) as usize, (i.regs >> 4) as usize);
            pc += 1;
            let jump = |c: bool| if c { i.off as usize } else { 0 };
            match i.code {
                LDX_MEM_W => {
                    assert_eq!(src, 1);
                    r[dst] = i64::from(ctx[i.off as usize / 4]);
                }
                ALU64_AND_K => r[dst] &= i64::from(i.imm),
                ALU64_MOV_K => r[dst] = i64::from(i.imm),
                JMP_JEQ_K => pc += jump(r[dst] == i64::from(i.imm)),
                JMP_JNE_K => pc += jump(r[dst] != i64::from(i.imm)),
                JMP_JGT_K => pc += jump(r[dst] > i64::from(i.imm)),
                JMP_EXIT => return r[0],
                c => panic!("opcode {c:#x}"),
            }
        }
    }

    #[test]
    fn a_task_opens_its_gpus_and_its_mig_capabilities_only() {
        let caps = CapsRule {
            major: 508,
            allowed: vec![5, 6],
            listed: vec![1, 2, 3, 4, 5, 6],
        };
        let p = program(195, &[1], Some(&caps));
        let char = DEV_CHAR as u32;
        for (ty, major, minor, allowed) in [
            (char, 195, 1, 1),   // its GPU
            (char, 195, 0, 0),   // another GPU
            (char, 195, 255, 1), // nvidiactl
            (char, 508, 5, 1),   // its GPU instance
            (char, 508, 6, 1),   // its compute instance
            (char, 508, 3, 0),   // another instance
            (char, 508, 1, 0),   // MIG config
            (char, 508, 99, 0),  // anything else of the major
            (1, 508, 3, 1),      // a block device of that number
            (char, 1, 3, 1),     // /dev/null
        ] {
            assert_eq!(verdict(&p, ty, major, minor), allowed, "{major}:{minor}");
        }
        // Without capabilities, the major is not touched.
        let p = program(195, &[1], None);
        assert_eq!(verdict(&p, char, 508, 3), 1);
        assert_eq!(verdict(&p, char, 195, 0), 0);
    }

    /// A major no driver of this machine has (in the dynamic range).
    const CAPS_MAJOR: u32 = 508;

    /// On this machine's cgroup v2 hierarchy (any, with or without
    /// controllers: device programs need none), as root: a process in a
    /// group with the program opens its own GPU's node and its own MIG
    /// capability (ENXIO: no driver behind the fake nodes) and is refused
    /// another GPU's and another instance's (EPERM).
    #[test]
    fn a_process_in_the_group_opens_only_its_gpus_node() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: not root");
            return;
        }
        let Some(v2) = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(Path::new)
            .find(|p| p.join("cgroup.procs").exists() && p.join("cgroup.max.depth").exists())
        else {
            eprintln!("skipped: no cgroup v2 hierarchy mounted");
            return;
        };
        let dir = v2.join(format!("gpuflow-devbpf-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let caps = CapsRule {
            major: CAPS_MAJOR,
            allowed: vec![5],
            listed: vec![3, 5],
        };
        if let Err(e) = deny_gpus(&dir, &[0], Some(&caps)) {
            let _ = std::fs::remove_dir(&dir);
            eprintln!("skipped: {e}");
            return;
        }
        eprintln!("cgroup v2 device program attached on {}", v2.display());
        let nodes = tempfile::tempdir().unwrap();
        // Its GPU, another, its MIG capability, another instance's.
        let made = [
            ("nvidia0", 195, 0),
            ("nvidia1", 195, 1),
            ("cap5", CAPS_MAJOR, 5),
            ("cap3", CAPS_MAJOR, 3),
        ];
        for (name, major, minor) in made {
            let p = std::ffi::CString::new(format!("{}/{name}", nodes.path().display())).unwrap();
            // SAFETY: a C string; mknod has no memory-safety preconditions.
            let r = unsafe {
                libc::mknod(
                    p.as_ptr(),
                    libc::S_IFCHR | 0o666,
                    libc::makedev(major, minor),
                )
            };
            assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        }
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
            .unwrap();
        let paths: Vec<std::ffi::CString> = made
            .iter()
            .map(|(name, _, _)| {
                std::ffi::CString::new(format!("{}/{name}", nodes.path().display())).unwrap()
            })
            .collect();
        // SAFETY: the child makes only system calls and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above.
            unsafe {
                if libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    libc::_exit(10);
                }
                let errno_of = |p: &std::ffi::CString| {
                    let fd = libc::open(p.as_ptr(), libc::O_RDONLY);
                    if fd >= 0 {
                        libc::close(fd);
                        return 0;
                    }
                    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
                };
                let own = errno_of(&paths[0]);
                let other = errno_of(&paths[1]);
                let own_cap = errno_of(&paths[2]);
                let other_cap = errno_of(&paths[3]);
                libc::_exit(if own != libc::ENXIO || other != libc::EPERM {
                    20
                } else if own_cap != libc::ENXIO || other_cap != libc::EPERM {
                    30
                } else {
                    0
                });
            }
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        let _ = std::fs::remove_dir(&dir);
        assert!(libc::WIFEXITED(status));
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "own nodes ENXIO, others EPERM (20: GPUs, 30: MIG capabilities)"
        );
    }
}
