//! Tenant-escape tests: a member's job on a separate agent and on
//! `gpuflow up` tries every route to the platform's secrets that worked
//! before (the agent's command line and environment, the data directory by
//! absolute and relative paths, the database and its WAL, the agent's
//! records, another team's job's environment: each team's tasks run under a
//! uid of the team's own), and all of them fail.
//!
//! The privilege drop needs the agent to run as root (as CI does); without
//! it the tests say so and check only what holds for any user.

mod common;

use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(60);

/// Prints what a hostile task can reach, one line per attempt.
const ATTACK: &str = r#"
echo "uid=$(id -u)"
echo "cmdline: $(tr '\0' ' ' </proc/$PPID/cmdline 2>&1)"
echo "environ: $(tr '\0' ' ' </proc/$PPID/environ 2>&1)"
echo "env: $(env | tr '\n' ' ')"
d=$(tr '\0' '\n' </proc/$PPID/cmdline | grep -A1 -- --data-dir | tail -1)
for f in "$d/admin.token" "$d/join.token" "$d/gpuflow.db" "$d/gpuflow.db-wal" \
         "$SERVER_DATA/admin.token" "$SERVER_DATA/join.token" "$SERVER_DATA/gpuflow.db" "$SERVER_DATA/gpuflow.db-wal" \
         ../../node.token ../../tasks.json ../../../admin.token ../../../join.token ../../../gpuflow.db-wal; do
  echo "read $f: $(head -c 300 "$f" 2>&1 | tr -d '\0')"
done
echo "others: $(grep -a -o 'DB_PASSWORD=[a-z0-9]*' /proc/[0-9]*/environ 2>/dev/null | tr '\n' ' ')"
echo "list: $(ls ../.. 2>&1 | tr '\n' ' ')"
echo done-attacking
"#;

fn attack_yaml(queue: &str, server_data: &str) -> String {
    format!(
        "name: attack\nqueue: {queue}\ntasks:\n  - name: main\n    command: [sh, -c, {ATTACK:?}]\n    env: {{SERVER_DATA: {server_data:?}}}\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {{count: 1}}}}\n"
    )
}

/// A victim job of team beta holding a secret in its environment.
const VICTIM: &str = "name: victim\nqueue: beta-q\ntasks:\n  - name: main\n    command: [sleep, '300']\n    env: {DB_PASSWORD: hunter2}\n    resources: {cpu: 0.1, memory_mib: 64, gpu: {count: 1}}\n";

fn as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Runs the attack next to the victim and checks that nothing leaked.
fn attack(api: &Api, admin: &str, server_data: &std::path::Path, secrets: &[&str]) {
    let (mallory, victor) = api.alpha_and_beta(admin);
    let (s, v) = api.submit_yaml(&victor, VICTIM);
    assert_eq!(s, 201, "{v}");
    let victim = v["id"].as_u64().unwrap();
    api.wait_state(victim, &victor, "running", LONG);
    let (s, v) = api.submit_yaml(
        &mallory,
        &attack_yaml("alpha-q", &server_data.display().to_string()),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    let log = poll("the attack finishes", LONG, || {
        let l = api.get(&format!("/v1/jobs/{id}/logs"), &mallory);
        let text = l["tasks"]["main/0"].as_str().unwrap_or("").to_string();
        text.contains("done-attacking").then_some(text)
    });
    println!("{log}");
    for s in secrets.iter().chain(&["hunter2"]) {
        assert!(!log.contains(s), "the task read {s:?}:\n{log}");
    }
    if as_root() {
        // Alpha's own uid: the first uid of the installation's block (the
        // agent's default base plus the block) plus the team's number.
        let teams = api.get("/v1/teams", admin);
        let alpha = teams
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "alpha")
            .unwrap()["uid"]
            .as_u64()
            .unwrap();
        let base = api.get("/v1/nodes", admin)[0]["inventory"]["limits"]["task_uid_base"]
            .as_u64()
            .expect("a root agent reports its installation's uid block");
        assert!(base >= gpuflow_agent::task::DEFAULT_TASK_UID_BASE as u64);
        assert_eq!(
            (base - gpuflow_agent::task::DEFAULT_TASK_UID_BASE as u64) % 10_000,
            0
        );
        let uid = base + alpha;
        assert!(log.contains(&format!("uid={uid}\n")), "{log}");
    } else {
        println!("not root: tasks run as the agent's own user; the privilege drop was not tested");
    }
}

#[test]
fn a_job_on_a_separate_agent_reaches_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let srv = server(dir.path(), port, &[]);
    let admin = admin_token(dir.path());
    let _agent = agent_env(
        dir.path(),
        &srv.url,
        "n1",
        "2",
        &[("AGENT_SECRET", "s3cr3t-of-the-agent")],
    );
    let api = Api::new(&srv.url);
    poll("the node registers", LONG, || {
        (api.get("/v1/nodes", &admin).as_array()?.len() == 1).then_some(())
    });
    // The agent writes its token once the server's answer is in.
    let node_token = poll("the agent keeps its node token", LONG, || {
        std::fs::read_to_string(dir.path().join("work-n1/node.token")).ok()
    });
    attack(
        &api,
        &admin,
        &dir.path().join("data"),
        &[
            JOIN,
            admin.as_str(),
            node_token.trim(),
            "s3cr3t-of-the-agent",
        ],
    );
    // The agent's command line carries no token at all.
    let cmdline = std::fs::read_to_string(format!("/proc/{}/cmdline", _agent.0.id())).unwrap();
    assert!(!cmdline.contains(JOIN), "{cmdline}");
}

#[test]
fn a_job_on_gpuflow_up_reaches_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let data = dir.path().join("data");
    let (_up, api, admin) = up(&data, port, "2", &[("AGENT_SECRET", "s3cr3t-of-up")]);
    let join = std::fs::read_to_string(data.join("join.token")).unwrap();
    attack(
        &api,
        &admin,
        &data,
        &[admin.as_str(), join.trim(), "s3cr3t-of-up"],
    );
}

/// Two installations whose agents share a node gave their teams the same
/// uids (the agent's base plus the team's number): each team of one could
/// read the other's processes and files. Each installation now has a uid
/// block of its own, claimed on the node while its agents run.
#[test]
fn two_installations_on_one_node_give_their_teams_different_uids() {
    if !as_root() {
        println!("not root: tasks run as the agent's own user; nothing to compare");
        return;
    }
    let uid_of_default_team = |dir: &std::path::Path| {
        let srv = server(dir, free_port(), &[]);
        let _agent = agent(dir, &srv.url, "n1", "1");
        let api = Api::new(&srv.url);
        let admin = admin_token(dir);
        let (s, v) = api.submit_yaml(
            &admin,
            &job_yaml("who", "default", "batch", 1, "echo uid=$(id -u)", 1),
        );
        assert_eq!(s, 201, "{v}");
        let id = v["id"].as_u64().unwrap();
        api.wait_state(id, &admin, "succeeded", LONG);
        let l = api.get(&format!("/v1/jobs/{id}/logs"), &admin);
        let out = l["tasks"]["main/0"].as_str().unwrap_or("").to_string();
        out.trim()
            .strip_prefix("uid=")
            .expect(&out)
            .parse::<u64>()
            .unwrap()
    };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (ua, ub) = (uid_of_default_team(a.path()), uid_of_default_team(b.path()));
    println!("the default team runs as {ua} in one installation, {ub} in the other");
    assert_ne!(ua, ub, "two installations' first teams share a uid");
}
