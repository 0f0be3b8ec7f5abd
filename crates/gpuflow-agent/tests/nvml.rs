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
    drop(gpus);

    // A driver that does not initialise means no GPUs, not a crash.
    unsafe { std::env::set_var("FAKE_NVML_FAIL_INIT", "1") };
    let gpus = Gpus::open(Some(&lib), None);
    assert!(gpus.is_emulated());
    assert!(gpus.list().is_empty());
    assert!(gpus.nvml_error.is_some());
}
