//! One suite, two databases: every test runs against SQLite and against a
//! throwaway PostgreSQL server (skipped with a printed reason when PostgreSQL
//! is not installed).

use gpuflow_store::pgtest::TempPostgres;
use gpuflow_store::{Batch, EventQuery, NewAudit, NewEvent, Record, SqlStore, Store, Table};

fn rec(table: Table, key: &str, team: &str, doc: &str) -> Record {
    Record {
        table,
        key: key.into(),
        team: team.into(),
        state: "pending".into(),
        doc: doc.into(),
    }
}

fn event(job: u64, team: &str, kind: &str) -> NewEvent {
    NewEvent {
        at: 100 + job,
        job: Some(job),
        team: team.into(),
        kind: kind.into(),
        message: format!("{kind} {job}"),
    }
}

/// Whether `store` holds the job record `key`.
async fn has_job(store: &dyn Store, key: &str) -> bool {
    store
        .load(Table::Jobs)
        .await
        .unwrap()
        .iter()
        .any(|r| r.key == key)
}

async fn suite(store: &dyn Store) {
    // Put, overwrite, delete.
    let mut b = Batch::default();
    b.put.push(rec(Table::Jobs, "00000001", "a", "{\"v\":1}"));
    b.put.push(rec(Table::Jobs, "00000002", "b", "{\"v\":2}"));
    b.events.push(event(1, "a", "submitted"));
    b.events.push(event(2, "b", "submitted"));
    b.audit.push(NewAudit {
        at: 1,
        actor: "root".into(),
        action: "job.submit".into(),
        target: "job/1".into(),
        detail: String::new(),
    });
    store.commit(&b).await.unwrap();
    let mut b = Batch::default();
    b.put.push(rec(Table::Jobs, "00000001", "a", "{\"v\":3}"));
    b.delete.push((Table::Jobs, "00000002".into()));
    b.events.push(event(1, "a", "admitted"));
    store.commit(&b).await.unwrap();
    let jobs = store.load(Table::Jobs).await.unwrap();
    assert_eq!(jobs, vec![rec(Table::Jobs, "00000001", "a", "{\"v\":3}")]);
    // Reads by key: the ones that exist, in key order, in chunks of any size.
    let got = store
        .get_many(Table::Jobs, &["00000002".into(), "00000001".into()])
        .await
        .unwrap();
    assert_eq!(got, jobs);
    let many: Vec<String> = (0..1200).map(|i| format!("{i:08}")).collect();
    assert_eq!(store.get_many(Table::Jobs, &many).await.unwrap(), jobs);
    assert!(store.get_many(Table::Jobs, &[]).await.unwrap().is_empty());

    // Pages: in key order after a key, of one team or all, never more
    // than asked.
    let mut b = Batch::default();
    for i in 3..10 {
        let team = if i % 2 == 0 { "a" } else { "b" };
        b.put.push(rec(Table::Jobs, &format!("{i:08}"), team, "{}"));
    }
    store.commit(&b).await.unwrap();
    let keys = |rs: Vec<Record>| rs.into_iter().map(|r| r.key).collect::<Vec<_>>();
    let page = store.load_page(Table::Jobs, None, None, 3).await.unwrap();
    assert_eq!(keys(page), ["00000001", "00000003", "00000004"]);
    let page = store
        .load_page(Table::Jobs, Some("a"), Some("00000004"), 10)
        .await
        .unwrap();
    assert_eq!(keys(page), ["00000006", "00000008"]);
    let page = store
        .load_page(Table::Jobs, Some("b"), Some("00000009"), 10)
        .await
        .unwrap();
    assert!(page.is_empty());
    let mut b = Batch::default();
    for i in 3..10 {
        b.delete.push((Table::Jobs, format!("{i:08}")));
    }
    store.commit(&b).await.unwrap();

    // Events filter by job and team, in order, after a sequence number.
    let all = store
        .events(&EventQuery {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(all.len(), 3);
    assert!(all.windows(2).all(|w| w[0].seq < w[1].seq));
    let of_a = store
        .events(&EventQuery {
            team: Some("a".into()),
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        of_a.iter()
            .map(|e| e.event.kind.as_str())
            .collect::<Vec<_>>(),
        ["submitted", "admitted"]
    );
    let of_2 = store
        .events(&EventQuery {
            job: Some(2),
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(of_2.len(), 1);
    let later = store
        .events(&EventQuery {
            after: all[0].seq,
            limit: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].seq, all[1].seq);
    // A time window (at or after `since`, before `until`), and the newest
    // events, still oldest first.
    let window = async |since: u64, until: u64| {
        store
            .events(&EventQuery {
                since: Some(since),
                until: Some(until),
                limit: 100,
                ..Default::default()
            })
            .await
    };
    let seqs = |v: Vec<gpuflow_store::StoredEvent>| v.iter().map(|e| e.seq).collect::<Vec<_>>();
    // Job 1's events are at 101, job 2's at 102.
    assert_eq!(seqs(window(102, 103).await.unwrap()), [all[1].seq]);
    assert_eq!(
        seqs(window(101, 102).await.unwrap()),
        [all[0].seq, all[2].seq]
    );
    let newest = store
        .events(&EventQuery {
            limit: 2,
            newest: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        newest.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [all[1].seq, all[2].seq]
    );
    assert_eq!(store.audit(0, 10).await.unwrap().len(), 1);

    // A failing batch leaves nothing behind: an empty key breaks a CHECK
    // constraint on both databases, after the event and a record were written.
    let before = store
        .events(&EventQuery {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap()
        .len();
    let mut bad = Batch::default();
    bad.events.push(event(9, "a", "ghost"));
    bad.put.push(rec(Table::Jobs, "00000009", "a", "{}"));
    bad.put.push(rec(Table::Jobs, "", "a", "{}"));
    assert!(
        store.commit(&bad).await.is_err(),
        "an empty key was accepted"
    );
    {
        let after = store
            .events(&EventQuery {
                limit: 100,
                ..Default::default()
            })
            .await
            .unwrap()
            .len();
        assert_eq!(before, after, "a failed batch stored its event");
        assert!(
            !has_job(store, "00000009").await,
            "a failed batch stored a record"
        );
    }

    // The same when the statement that fails comes after others of the
    // batch that went through (on SQLite, in the same round trip): the
    // record written before it and the audit line are not kept.
    let mut bad = Batch::default();
    bad.put.push(rec(Table::Jobs, "00000010", "a", "{}"));
    bad.put.push(rec(Table::Nodes, "", "", "{}"));
    bad.events.push(event(10, "a", "ghost"));
    bad.audit.push(NewAudit {
        at: 2,
        actor: "root".into(),
        action: "job.submit".into(),
        target: "job/10".into(),
        detail: String::new(),
    });
    assert!(
        store.commit(&bad).await.is_err(),
        "an empty key was accepted"
    );
    assert!(
        !has_job(store, "00000010").await,
        "a failed batch stored the record written before its failure"
    );
    assert_eq!(store.audit(0, 10).await.unwrap().len(), 1);

    // A large batch, written many rows a statement: every record, a key
    // put twice keeping its last record (what upserting one after another
    // leaves; PostgreSQL refuses one statement that upserts a key twice),
    // and events in their order across statements.
    let seen = store
        .events(&EventQuery {
            limit: 10_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .len();
    let mut big = Batch::default();
    for i in 0..700 {
        big.put.push(rec(
            Table::Nodes,
            &format!("n{i:04}"),
            "",
            &format!("{{\"v\":{i}}}"),
        ));
        big.events.push(event(1000 + i, "a", "heartbeat"));
        if i == 5 {
            big.put
                .push(rec(Table::Nodes, "n0003", "", "{\"v\":\"last\"}"));
        }
    }
    big.put.push(rec(Table::Teams, "t", "t", "{}"));
    store.commit(&big).await.unwrap();
    let nodes = store.load(Table::Nodes).await.unwrap();
    assert_eq!(nodes.len(), 700);
    assert_eq!(nodes[3].doc, "{\"v\":\"last\"}");
    assert_eq!(nodes[699].doc, "{\"v\":699}");
    assert_eq!(store.load(Table::Teams).await.unwrap().len(), 1);
    let events = store
        .events(&EventQuery {
            limit: 10_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let jobs: Vec<u64> = events[seen..].iter().filter_map(|e| e.event.job).collect();
    assert_eq!(jobs, (1000..1700).collect::<Vec<u64>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("gpuflow.db").display());
    let store = SqlStore::open(&url).await.unwrap();
    assert_eq!(store.backend(), "sqlite");
    suite(&store).await;
    drop(store);
    // Reopening runs no migration twice and keeps the data.
    let again = SqlStore::open(&url).await.unwrap();
    assert_eq!(again.load(Table::Jobs).await.unwrap().len(), 1);
}

/// SQLite's write-ahead log is copied back into the database beside the
/// commits (its commits no longer do it when the log grows long): what
/// 100 commits wrote, 1 MB in all, reaches the database file within a few
/// checkpoint periods. Without the checkpoints the file stays at its one
/// page while the log grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_log_is_copied_back_beside_the_commits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpuflow.db");
    let store = SqlStore::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let doc = "x".repeat(1000);
    for i in 0..100 {
        let b = Batch {
            put: (0..10)
                .map(|k| rec(Table::Jobs, &format!("{i:05}-{k}"), "t", &doc))
                .collect(),
            ..Batch::default()
        };
        store.commit(&b).await.unwrap();
    }
    let mut size = 0;
    for _ in 0..100 {
        size = std::fs::metadata(&path).unwrap().len();
        if size > 1_000_000 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        size > 1_000_000,
        "the database file is {size} bytes 5 s after the commits: the log was not copied back"
    );
    assert_eq!(store.load(Table::Jobs).await.unwrap().len(), 1000);
}

/// Pooled PostgreSQL connections that the database cut while they sat
/// idle (as a restart of the database or a proxy's timeout does) are
/// replaced before a commit uses them: the commit goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connections_cut_while_idle_are_replaced() {
    let Some(pg) = postgres() else {
        return;
    };
    let store = SqlStore::open(&pg.url).await.unwrap();
    let mut b = Batch::default();
    b.put.push(rec(Table::Jobs, "00000001", "a", "{}"));
    store.commit(&b).await.unwrap();
    let mut admin = <sqlx::AnyConnection as sqlx::Connection>::connect(&pg.url)
        .await
        .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    .execute(&mut admin)
    .await
    .unwrap();
    // Idle for longer than a connection is trusted without a check.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let mut b = Batch::default();
    b.put.push(rec(Table::Jobs, "00000002", "a", "{}"));
    store.commit(&b).await.unwrap();
    assert_eq!(store.load(Table::Jobs).await.unwrap().len(), 2);
}

/// A throwaway PostgreSQL; `None`, with the reason printed, where it is not
/// installed.
fn postgres() -> Option<TempPostgres> {
    match TempPostgres::start() {
        Ok(pg) => {
            if pg.is_none() {
                eprintln!("skipped: PostgreSQL is not installed (apt-get install postgresql)");
            }
            pg
        }
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store() {
    let Some(pg) = postgres() else { return };
    let store = SqlStore::open(&pg.url).await.unwrap();
    assert_eq!(store.backend(), "postgres");
    suite(&store).await;
    drop(store);
    let again = SqlStore::open(&pg.url).await.unwrap();
    assert_eq!(again.load(Table::Jobs).await.unwrap().len(), 1);
}

#[tokio::test]
async fn unknown_url_is_refused() {
    let e = SqlStore::open("mysql://x").await.err().unwrap();
    assert!(e.to_string().contains("sqlite://"), "{e}");
}

/// Two servers on one database: one holds the lease, the other waits; once
/// the holder lets it lapse the other takes it with a larger token, and the
/// deposed holder's commits are refused and store nothing.
async fn lease(a: &dyn Store, b: &dyn Store) {
    let first = a.acquire_lease("a", "http://a", 30).await.unwrap().unwrap();
    a.fence(first);
    let held = b
        .acquire_lease("b", "http://b", 30)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        (held.holder.as_str(), held.addr.as_str()),
        ("a", "http://a")
    );
    assert!(held.expires_in > 20, "{held:?}");
    let mut batch = Batch::default();
    batch.put.push(rec(Table::Jobs, "00000010", "a", "{}"));
    a.commit(&batch).await.unwrap();
    assert!(a.renew_lease(first, 30).await.unwrap());
    // The holder stops renewing: a lease of 0 s lapses at once.
    assert!(a.renew_lease(first, 0).await.unwrap());
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let second = b.acquire_lease("b", "http://b", 30).await.unwrap().unwrap();
    assert!(second > first, "{second} > {first}");
    b.fence(second);
    let mut late = Batch::default();
    late.put.push(rec(Table::Jobs, "00000011", "a", "{}"));
    let e = a.commit(&late).await.unwrap_err();
    assert!(
        matches!(e, gpuflow_store::StoreError::Fenced { token } if token == first),
        "{e}"
    );
    assert!(
        !a.renew_lease(first, 30).await.unwrap(),
        "it is not a's to renew"
    );
    let keys: Vec<String> = b
        .load(Table::Jobs)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert!(keys.contains(&"00000010".to_string()), "{keys:?}");
    assert!(!keys.contains(&"00000011".to_string()), "{keys:?}");
    b.commit(&late).await.unwrap();
    // A clean stop hands the lease on at once.
    b.release_lease(second).await.unwrap();
    let third = a.acquire_lease("a", "http://a", 30).await.unwrap().unwrap();
    assert_eq!(third, second + 1);
}

#[tokio::test]
async fn sqlite_lease_fences_a_deposed_leader() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("gpuflow.db").display());
    let a = SqlStore::open(&url).await.unwrap();
    let b = SqlStore::open(&url).await.unwrap();
    lease(&a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_fences_a_deposed_leader() {
    let Some(pg) = postgres() else { return };
    let a = SqlStore::open(&pg.url).await.unwrap();
    let b = SqlStore::open(&pg.url).await.unwrap();
    lease(&a, &b).await;
}
