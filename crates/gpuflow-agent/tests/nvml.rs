//! GPU discovery through the real `nvml-wrapper` against the fake
//! `libnvidia-ml.so.1` built from C (skipped, with the reason printed, when
//! there is no C compiler). One test, because the fake reads process-wide
//! environment variables.

use gpuflow_agent::fake_nvml;
use gpuflow_agent::gpu::Gpus;

#[test]
fn nvml_discovery_through_the_fake_library() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = fake_nvml::build(dir.path()).unwrap() else {
        eprintln!("skipped: no C compiler to build the fake NVML library");
        return;
    };
    // SAFETY: this test binary has one test; nothing else reads the environment concurrently.
    unsafe {
        std::env::set_var("FAKE_NVML_GPUS", "3");
        std::env::set_var("FAKE_NVML_MEM_MIB", "81559");
    }
    let threads_before = threads();
    let gpus = Gpus::open(Some(&lib), None);
    assert!(
        !gpus.is_emulated(),
        "NVML did not load: {:?}",
        gpus.nvml_error
    );
    let list = gpus.list();
    assert_eq!(list.len(), 3);
    assert_eq!(list[2].index, 2);
    assert_eq!(list[0].model, "H100-80GB-HBM3");
    assert_eq!(list[0].memory_mib, 81559);
    assert_eq!(list[1].uuid, "GPU-fa4e0000-0000-0000-0000-000000000001");
    assert_eq!(list[1].unhealthy, None);
    assert!(list[0].mig.is_empty(), "not in MIG mode");
    drop(gpus);
    // Dropping the GPUs stops the thread that waits on NVML's events before
    // it returns: no thread calls into the library afterwards (the
    // environment changes below raced it, and the fake's getenv crashed).
    assert_eq!(
        threads(),
        threads_before,
        "the event thread outlived its Gpus"
    );

    // GPUs in MIG mode: their instances, profiles, memory and UUIDs, read
    // (never set) through NVML.
    unsafe { std::env::set_var("FAKE_NVML_MIG", "1g.10gb,1g.10gb,3g.40gb") };
    let gpus = Gpus::open(Some(&lib), None);
    let list = gpus.list();
    let mig = &list[1].mig;
    assert_eq!(mig.len(), 3, "{list:?}");
    assert_eq!(
        mig.iter().map(|m| m.profile.as_str()).collect::<Vec<_>>(),
        ["1g.10gb", "1g.10gb", "3g.40gb"]
    );
    assert_eq!(mig[2].memory_mib, 40 * 1024);
    assert_eq!(mig[1].uuid, "MIG-fa4e0000-0000-0000-0001-000000000001");
    // Each instance's place, for its capability devices: GPU 1's minor
    // (its index: the fake library has no minor numbers), the instance ids
    // NVML gives (the fake's: instance k is GPU instance k + 1).
    let ids = gpus.mig_ids();
    assert_eq!(ids.len(), 3 * list.len(), "{ids:?}");
    assert_eq!(
        ids[&mig[1].uuid],
        gpuflow_agent::migcaps::MigId {
            gpu_minor: 1,
            gi: 2,
            ci: 0
        }
    );
    drop(gpus);
    unsafe { std::env::remove_var("FAKE_NVML_MIG") };

    // NVLink peers and NUMA nodes, from NVML's peer-to-peer status and NUMA ids.
    unsafe {
        std::env::set_var("FAKE_NVML_NVLINK", "0-1");
        std::env::set_var("FAKE_NVML_NUMA", "0,1,1");
    }
    let gpus = Gpus::open(Some(&lib), None);
    let list = gpus.list();
    assert_eq!(list[0].nvlink, [1]);
    assert_eq!(list[1].nvlink, [0]);
    assert!(list[2].nvlink.is_empty(), "{list:?}");
    assert_eq!(
        list.iter().map(|g| g.numa).collect::<Vec<_>>(),
        [Some(0), Some(1), Some(1)]
    );
    drop(gpus);
    unsafe {
        std::env::remove_var("FAKE_NVML_NVLINK");
        std::env::remove_var("FAKE_NVML_NUMA");
    }

    // Samples: utilisation, memory, power, temperature and the compute
    // processes, from a state file the test rewrites. The inventory does
    // not change with them (it would be stored on every heartbeat).
    let state = dir.path().join("state");
    unsafe { std::env::set_var("FAKE_NVML_STATE", &state) };
    // Written whole (a new file renamed over the old), as the library's
    // threads read it at any moment.
    let write = |text: &str| {
        let tmp = state.with_extension("new");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &state).unwrap();
    };
    write(
        "gpu 0 util 80 memutil 40 used_mib 30000 power_mw 350000 temp 71\nproc 0 4242 20480 65\n",
    );
    // A watcher slow to register (a loaded machine): `open` returns only
    // once it watches, so the XID errors written below are all seen (they
    // were missed now and then: NVML delivers only later events).
    unsafe { std::env::set_var("FAKE_NVML_EVENTSET_DELAY_MS", "500") };
    let gpus = Gpus::open(Some(&lib), None);
    unsafe { std::env::remove_var("FAKE_NVML_EVENTSET_DELAY_MS") };
    let before = gpus.list();
    let (samples, procs) = gpus.sample();
    assert_eq!(samples.len(), 3);
    assert_eq!(
        (
            samples[0].util_pct,
            samples[0].memory_util_pct,
            samples[0].memory_used_mib
        ),
        (80, 40, 30000)
    );
    assert_eq!(samples[0].power_w, Some(350.0));
    assert_eq!(samples[0].temperature_c, Some(71));
    assert_eq!(
        samples[1].util_pct, 11,
        "a GPU the file does not name keeps the default"
    );
    assert_eq!(procs.len(), 1);
    assert_eq!(
        (
            procs[0].gpu,
            procs[0].pid,
            procs[0].memory_mib,
            procs[0].sm_util
        ),
        (0, 4242, 20480, Some(65))
    );
    write("gpu 0 util 3 memutil 1 used_mib 1000 power_mw 90000 temp 40\n");
    let (samples, procs) = gpus.sample();
    assert_eq!(samples[0].util_pct, 3);
    assert!(procs.is_empty());
    assert_eq!(gpus.list(), before, "samples are not part of the inventory");

    // Health: a critical XID error marks its GPU until an admin clears it;
    // an application's XID (13) does not; new uncorrected ECC errors and a
    // GPU that fell off the bus are unhealthy while they last.
    write("xid 1 13\nxid 2 79\n");
    let list = poll_list(&gpus, |l| l[2].unhealthy.is_some());
    assert!(
        list[2].unhealthy.as_deref().unwrap().contains("XID 79"),
        "{list:?}"
    );
    assert_eq!(list[1].unhealthy, None, "XID 13 is the program's fault");
    write("xid 1 13\nxid 2 79\necc 0 3\nlost 1\n");
    let list = gpus.list();
    assert_eq!(list.len(), 3, "a lost GPU stays in the inventory: {list:?}");
    assert!(
        list[0]
            .unhealthy
            .as_deref()
            .unwrap()
            .contains("3 new uncorrected ECC errors")
    );
    assert!(
        list[1]
            .unhealthy
            .as_deref()
            .unwrap()
            .contains("fell off the bus")
    );
    assert_eq!(list[1].uuid, before[1].uuid);
    write("xid 1 13\nxid 2 79\necc 0 3\n");
    gpus.clear_health(u64::MAX);
    let list = gpus.list();
    assert!(
        list.iter().all(|g| g.unhealthy.is_none()),
        "cleared: {list:?}"
    );
    drop(gpus);
    unsafe { std::env::remove_var("FAKE_NVML_STATE") };

    // A driver that does not initialise means no GPUs, not a crash.
    unsafe { std::env::set_var("FAKE_NVML_FAIL_INIT", "1") };
    let gpus = Gpus::open(Some(&lib), None);
    assert!(gpus.is_emulated());
    assert!(gpus.list().is_empty());
    assert!(gpus.nvml_error.is_some());
}

/// The inventory once `ok` holds (XID events arrive on NVML's event thread).
fn poll_list(
    gpus: &Gpus,
    ok: impl Fn(&[gpuflow_api::GpuInfo]) -> bool,
) -> Vec<gpuflow_api::GpuInfo> {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let l = gpus.list();
        if ok(&l) || std::time::Instant::now() > end {
            return l;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// This process's threads.
fn threads() -> usize {
    procfs::process::Process::myself()
        .and_then(|p| p.tasks())
        .map(|tasks| tasks.flatten().count())
        .expect("/proc/self/task is readable")
}
