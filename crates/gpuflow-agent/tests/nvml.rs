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
    assert_eq!(list[1].utilization, Some(11));
    assert!(list[0].mig.is_empty(), "not in MIG mode");
    drop(gpus);

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

    // A driver that does not initialise means no GPUs, not a crash.
    unsafe { std::env::set_var("FAKE_NVML_FAIL_INIT", "1") };
    let gpus = Gpus::open(Some(&lib), None);
    assert!(gpus.is_emulated());
    assert!(gpus.list().is_empty());
    assert!(gpus.nvml_error.is_some());
}
