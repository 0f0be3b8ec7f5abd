//! The FGD paper's experiment on the public openb trace, through gpuflow's core.
//! These tests read `../shared/data/openb` (as CI lays it out); where the trace
//! is absent they print why and pass without checking anything.

use std::path::PathBuf;

use gpuflow_core::Policy;
use gpuflow_sim::fragmentation::{self, Config};
use gpuflow_sim::openb;

fn trace_dir() -> Option<PathBuf> {
    let dir = openb::default_dir();
    if dir.join(openb::GPU_NODE_LIST).exists() {
        Some(dir)
    } else {
        eprintln!(
            "skipped: the openb trace is not at {} (see README: where the trace comes from)",
            dir.display()
        );
        None
    }
}

#[test]
fn openb_default_reproduces_the_paper_and_gpuflow_beats_its_fgd() {
    let Some(dir) = trace_dir() else { return };
    let (nodes, pods) = openb::load(&dir, "default").unwrap();
    assert_eq!(nodes.len(), 1213);
    assert_eq!(nodes.iter().map(|n| n.gpus.len()).sum::<usize>(), 6212);
    let cfg = Config {
        policies: vec![
            Policy::random(),
            Policy::best_fit(),
            Policy::fgd(),
            Policy::gpuflow(),
        ],
        ..Config::default()
    };
    assert_eq!(cfg.seeds, (42..=51).collect::<Vec<_>>());
    let runs = fragmentation::run_all(&nodes, &pods, &cfg, &|| {}).unwrap();
    let s = fragmentation::summarize(&runs, &cfg);
    let at100 = |name: &str| s.iter().find(|x| x.policy == name).unwrap().unallocated[100];
    let (random, best_fit, fgd, gpuflow) = (
        at100("random"),
        at100("best-fit"),
        at100("fgd"),
        at100("gpuflow"),
    );
    eprintln!(
        "unallocated GPU % at 100% arrived: random {random:.2}, best-fit {best_fit:.2}, fgd {fgd:.2}, gpuflow {gpuflow:.2}"
    );
    // The paper's Figure 9: random 13.70, best-fit 7.14, FGD 4.77.
    assert!(
        (random - 13.70).abs() <= 0.7,
        "random {random:.2} is not within 0.7 of the paper's 13.70"
    );
    assert!(
        (best_fit - 7.14).abs() <= 0.7,
        "best-fit {best_fit:.2} is not within 0.7 of the paper's 7.14"
    );
    // Our FGD is the paper's as its simulator runs it (it was 5.6 before
    // the simulator's scoring and tie-break were followed).
    assert!(
        (fgd - 4.77).abs() <= 0.7,
        "fgd {fgd:.2} is not within 0.7 of the paper's 4.77"
    );
    assert!(
        gpuflow < 4.77 && gpuflow < fgd,
        "gpuflow {gpuflow:.2} does not beat FGD (the paper's 4.77, ours {fgd:.2})"
    );
    // Every run accounts for every pod, and unallocated never grows as load arrives.
    for r in &runs {
        assert_eq!(r.placed + r.dropped, r.pods);
        assert!(
            r.unallocated.windows(2).all(|w| w[1] <= w[0] + 1e-9),
            "{} seed {}",
            r.policy,
            r.seed
        );
    }
}

#[test]
fn openb_gpushare100_reproduces_the_papers_fgd_and_gpuflow_beats_it() {
    let Some(dir) = trace_dir() else { return };
    let (nodes, pods) = openb::load(&dir, "gpushare100").unwrap();
    let cfg = Config {
        policies: vec![Policy::fgd(), Policy::gpuflow()],
        ..Config::default()
    };
    let runs = fragmentation::run_all(&nodes, &pods, &cfg, &|| {}).unwrap();
    let s = fragmentation::summarize(&runs, &cfg);
    let at100 = |name: &str| s.iter().find(|x| x.policy == name).unwrap().unallocated[100];
    let (fgd, gpuflow) = (at100("fgd"), at100("gpuflow"));
    eprintln!("gpushare100, unallocated GPU % at 100% arrived: fgd {fgd:.2}, gpuflow {gpuflow:.2}");
    // The paper's GPU-sharing experiment puts FGD at about 13.4 % on this list; ours was
    // 19.1 % while it broke equal scores at random.
    assert!(
        (fgd - 13.4).abs() <= 0.7,
        "fgd {fgd:.2} is not within 0.7 of the paper's 13.4"
    );
    assert!(
        gpuflow < fgd,
        "gpuflow {gpuflow:.2} does not beat fgd {fgd:.2}"
    );
}

#[test]
fn openb_arrivals_inflate_to_the_target_and_depend_only_on_the_seed() {
    let Some(dir) = trace_dir() else { return };
    let (nodes, pods) = openb::load(&dir, "gpushare40").unwrap();
    let capacity: u64 = nodes.iter().map(|n| n.gpus.len() as u64 * 1000).sum();
    let a = fragmentation::arrivals(&pods, capacity, 1.3, 42);
    let b = fragmentation::arrivals(&pods, capacity, 1.3, 42);
    let c = fragmentation::arrivals(&pods, capacity, 1.3, 43);
    assert_eq!(a, b);
    assert_ne!(a, c);
    let total: u64 = a.iter().map(|&i| pods[i].gpu_milli()).sum();
    let last = pods[*a.last().unwrap()].gpu_milli();
    assert!(
        total as f64 >= 1.3 * capacity as f64,
        "inflation stops short of the target"
    );
    assert!(
        ((total - last) as f64) < 1.3 * capacity as f64,
        "inflation goes past the target"
    );
    // The original pods all come first, each once.
    let mut head = a[..pods.len()].to_vec();
    head.sort();
    assert_eq!(head, (0..pods.len()).collect::<Vec<_>>());
}

#[test]
fn every_published_pod_list_loads() {
    let Some(dir) = trace_dir() else { return };
    for name in openb::POD_LISTS {
        let pods = openb::load_pods(&dir.join(openb::pod_list_file(name).unwrap())).unwrap();
        assert!(pods.len() > 7000, "{name} has only {} pods", pods.len());
    }
}

#[test]
fn bad_trace_input_is_an_error_that_says_where() {
    let dir = std::env::temp_dir().join(format!("gpuflow-openb-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("pods.csv");
    std::fs::write(
        &f,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,500\np1,1000,1024,2,500\n",
    )
    .unwrap();
    let e = openb::load_pods(&f).unwrap_err().to_string();
    assert!(
        e.contains("line 3") && e.contains("only one GPU may be shared"),
        "{e}"
    );
    std::fs::write(
        &f,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,lots,1024,1,500\n",
    )
    .unwrap();
    let e = openb::load_pods(&f).unwrap_err().to_string();
    assert!(e.contains("line 2"), "{e}");
    let e = openb::load_pods(&dir.join("missing.csv"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot read"), "{e}");
    let e = openb::pod_list_file("nope").unwrap_err().to_string();
    assert!(e.contains("gpushare40"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
