//! gpuflow's durable state: the [`Store`] trait and its SQL implementation for
//! SQLite (embedded, the default, in WAL mode) and PostgreSQL (production).
//!
//! The store knows tables of records, an append-only event log and an audit
//! log; it does not know what a job or a queue means. The server keeps its
//! working state in memory and writes every change through a [`Batch`], which
//! commits in one transaction before the change is acknowledged: a batch is
//! all there or not there at all.
//!
//! Records are JSON documents with a few indexed columns (`team`, `state`).
//! Both databases run the same statements; only the migrations differ in
//! their column types.

mod migrate;
#[cfg(feature = "testing")]
pub mod pgtest;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;

use async_trait::async_trait;
use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::{AnyPool, Executor, Row};

/// What can fail in the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("unsupported database url {0:?}: use sqlite://PATH or postgres://…")]
    BadUrl(String),
    #[error("database error")]
    Db(#[from] sqlx::Error),
    /// The database did not answer in time.
    #[error("the database did not answer within {waited_ms} ms")]
    Unanswered { waited_ms: u64 },
    /// This server's leadership lease was taken over: its writes are refused.
    #[error("refused: this server's leadership (token {token}) was taken over by another server")]
    Fenced { token: u64 },
    #[error("migration {version} failed")]
    Migration {
        version: i64,
        #[source]
        source: sqlx::Error,
    },
}

/// The tables of records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    Teams,
    Users,
    Tokens,
    Queues,
    Nodes,
    Jobs,
    Meta,
    Projects,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Table::Teams => "teams",
            Table::Users => "users",
            Table::Tokens => "tokens",
            Table::Queues => "queues",
            Table::Nodes => "nodes",
            Table::Jobs => "jobs",
            Table::Meta => "meta",
            Table::Projects => "projects",
        }
    }
}

/// One record: a key, two indexed columns and a JSON document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub table: Table,
    pub key: String,
    pub team: String,
    pub state: String,
    pub doc: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewEvent {
    pub at: u64,
    pub job: Option<u64>,
    pub team: String,
    pub kind: String,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredEvent {
    pub seq: i64,
    pub event: NewEvent,
}

/// A piece of one task's output (stdout or stderr) of one attempt, from
/// byte `offset` of what the task wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogPiece {
    pub job: u64,
    pub attempt: u32,
    pub group: u16,
    pub index: u32,
    /// `out` or `err`.
    pub stream: String,
    pub offset: u64,
    pub text: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewAudit {
    pub at: u64,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub detail: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredAudit {
    pub seq: i64,
    pub entry: NewAudit,
}

/// Changes committed together.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub put: Vec<Record>,
    pub delete: Vec<(Table, String)>,
    pub events: Vec<NewEvent>,
    pub audit: Vec<NewAudit>,
    /// Output appended to tasks' logs.
    pub logs: Vec<LogPiece>,
}

impl Batch {
    /// Adds `other`'s entries after this batch's.
    pub fn append(&mut self, other: Batch) {
        self.put.extend(other.put);
        self.delete.extend(other.delete);
        self.events.extend(other.events);
        self.audit.extend(other.audit);
        self.logs.extend(other.logs);
    }

    pub fn is_empty(&self) -> bool {
        self.put.is_empty()
            && self.delete.is_empty()
            && self.events.is_empty()
            && self.audit.is_empty()
            && self.logs.is_empty()
    }
}

/// Which events to read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventQuery {
    pub job: Option<u64>,
    pub team: Option<String>,
    /// Only events with a larger sequence number.
    pub after: i64,
    pub limit: i64,
    /// Only events at or after this time (Unix seconds).
    pub since: Option<u64>,
    /// Only events before this time (Unix seconds).
    pub until: Option<u64>,
    /// The newest `limit` events (still returned oldest first), not the
    /// oldest.
    pub newest: bool,
}

/// Who holds the leadership lease of a store that several servers share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    /// The holder's name (unique per server process).
    pub holder: String,
    /// The address the holder serves at, for followers to point to.
    pub addr: String,
    /// Taken anew by each leader, one more than the last: the fencing token.
    pub token: u64,
    /// Seconds until the lease lapses unless renewed (negative: lapsed).
    pub expires_in: i64,
}

/// Durable state. Implementations commit a [`Batch`] atomically.
#[async_trait]
pub trait Store: Send + Sync {
    /// `sqlite` or `postgres`.
    fn backend(&self) -> &'static str;

    /// Every record of a table, in key order.
    ///
    /// # Errors
    /// On a database error.
    async fn load(&self, table: Table) -> Result<Vec<Record>, StoreError>;

    /// Up to `limit` records of a table with keys after `after` (from the
    /// first with `None`), in key order; only `team`'s with `Some`. A
    /// reader that pages through a table holds one page, not the table.
    ///
    /// # Errors
    /// On a database error.
    async fn load_page(
        &self,
        table: Table,
        team: Option<&str>,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Record>, StoreError>;

    /// The records of a table with these keys (those that exist), in key
    /// order.
    ///
    /// # Errors
    /// On a database error.
    async fn get_many(&self, table: Table, keys: &[String]) -> Result<Vec<Record>, StoreError>;

    /// Applies a batch in one transaction.
    ///
    /// # Errors
    /// On a database error; then nothing of the batch is stored.
    async fn commit(&self, batch: &Batch) -> Result<(), StoreError>;

    /// Takes the leadership lease for `ttl_s` seconds of the database's
    /// clock when no one holds it or its holder let it lapse: `Ok(token)`,
    /// one more than the last leader's; else `Err` with who holds it.
    ///
    /// # Errors
    /// On a database error.
    async fn acquire_lease(
        &self,
        holder: &str,
        addr: &str,
        ttl_s: u64,
    ) -> Result<Result<u64, Leader>, StoreError>;

    /// Extends the lease of `token` by `ttl_s` seconds from now: `false`
    /// when another server has taken it over.
    ///
    /// # Errors
    /// On a database error.
    async fn renew_lease(&self, token: u64, ttl_s: u64) -> Result<bool, StoreError>;

    /// Lets the lease of `token` lapse now (a clean stop), if it still holds.
    ///
    /// # Errors
    /// On a database error.
    async fn release_lease(&self, token: u64) -> Result<(), StoreError>;

    /// The lease's holder, if any server ever took it.
    ///
    /// # Errors
    /// On a database error.
    async fn leader(&self) -> Result<Option<Leader>, StoreError>;

    /// From now on every commit carries `token` and is refused
    /// ([`StoreError::Fenced`]), storing nothing, once another server has
    /// taken the lease: a deposed leader cannot write.
    fn fence(&self, token: u64);

    /// Events in sequence order.
    ///
    /// # Errors
    /// On a database error.
    async fn events(&self, q: &EventQuery) -> Result<Vec<StoredEvent>, StoreError>;

    /// The audit log in sequence order.
    ///
    /// # Errors
    /// On a database error.
    async fn audit(&self, after: i64, limit: i64) -> Result<Vec<StoredAudit>, StoreError>;

    /// A job's stored output, of one attempt or all, in the order it was
    /// appended.
    ///
    /// # Errors
    /// On a database error.
    async fn logs(&self, job: u64, attempt: Option<u32>) -> Result<Vec<LogPiece>, StoreError>;
}

/// Rows one statement writes at most: 256 rows of at most 7 values stay
/// far below SQLite's (32,766) and PostgreSQL's (65,535) bound on a
/// statement's parameters.
const ROWS_PER_STATEMENT: usize = 256;

/// `($1, $2), ($3, $4)` for `rows` rows of `cols` values; on SQLite
/// `(?, ?), (?, ?)`, bound in order. SQLite keeps a statement's named
/// parameters in a list that sqlx searches once per value it binds, so
/// numbered parameters cost time square in their count (half a second of
/// SQLite's thread to store a cycle that admits 25,000 jobs); anonymous
/// ones are not in that list.
fn placeholders(backend: &str, rows: usize, cols: usize) -> String {
    placeholders_after(backend, 0, rows, cols)
}

/// As [`placeholders`], numbered from `after + 1` on PostgreSQL: for a
/// statement that follows others in one.
fn placeholders_after(backend: &str, after: usize, rows: usize, cols: usize) -> String {
    use std::fmt::Write;
    let numbered = backend != "sqlite";
    let mut out = String::with_capacity(rows * cols * 6);
    let mut n = after;
    for r in 0..rows {
        if r > 0 {
            out.push_str(", ");
        }
        out.push('(');
        for c in 0..cols {
            if c > 0 {
                out.push_str(", ");
            }
            n += 1;
            if numbered {
                let _ = write!(out, "${n}");
            } else {
                out.push('?');
            }
        }
        out.push(')');
    }
    out
}

/// A pooled PostgreSQL connection idle longer than this is checked before
/// it is used again.
const CHECK_IDLE_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// Statements of one batch that run in one round trip at most: a group
/// of submissions writes three (jobs, events, audit lines). A larger
/// batch (a cycle's) runs one statement at a time, so that each cached
/// statement stays one chunk's.
const JOINED_STATEMENTS: usize = 8;

/// A value a statement binds.
enum Value<'a> {
    Int(i64),
    MaybeInt(Option<i64>),
    Text(&'a str),
}

/// Binds `values` in order.
fn bind_all<'q, 'a: 'q>(
    mut q: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments>,
    values: impl IntoIterator<Item = &'q Value<'a>>,
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments> {
    for v in values {
        q = match v {
            Value::Int(i) => q.bind(*i),
            Value::MaybeInt(i) => q.bind(*i),
            Value::Text(t) => q.bind(*t),
        };
    }
    q
}

/// PostgreSQL statements numbered on from one another, as one: the
/// last one's, with the others as `WITH` clauses before it.
fn with_clauses(statements: &[(String, Vec<Value<'_>>)]) -> String {
    let Some(((last, _), rest)) = statements.split_last() else {
        return String::new();
    };
    let mut sql = String::new();
    for (i, (s, _)) in rest.iter().enumerate() {
        sql.push_str(if i == 0 { "WITH " } else { ", " });
        sql.push_str(&format!("w{i} AS ({s})"));
    }
    if !sql.is_empty() {
        sql.push(' ');
    }
    sql.push_str(last);
    sql
}

/// The statements that write `batch`, each with the values it binds in
/// order: upserts of the latest puts by table, deletes, then new events,
/// audit lines and log pieces. SQLite's placeholders are anonymous, so
/// that statements joined in one string bind their values in turn;
/// PostgreSQL's are numbered, from 1 in each statement, or on from the
/// statements before it when `one` (to be joined into one statement).
fn statements<'a>(backend: &str, batch: &'a Batch, one: bool) -> Vec<(String, Vec<Value<'a>>)> {
    use Value::{Int, MaybeInt, Text};
    let mut out: Vec<(String, Vec<Value<'a>>)> = Vec::new();
    let mut bound = 0;
    let mut placeholders = |rows: usize, cols: usize| {
        let after = if one { bound } else { 0 };
        bound += rows * cols;
        placeholders_after(backend, after, rows, cols)
    };
    for (table, rows) in latest_puts(&batch.put) {
        let head = format!("INSERT INTO {} (key, team, state, doc)", table.name());
        let tail = " ON CONFLICT (key) DO UPDATE SET team = excluded.team, state = excluded.state, doc = excluded.doc";
        inserts(&mut out, &mut placeholders, &head, tail, &rows, |r| {
            let r: &'a Record = r;
            [Text(&r.key), Text(&r.team), Text(&r.state), Text(&r.doc)]
        });
    }
    for (t, key) in &batch.delete {
        let sql = format!(
            "DELETE FROM {} WHERE key = {}",
            t.name(),
            placeholders(1, 1).trim_matches(['(', ')'])
        );
        out.push((sql, vec![Text(key)]));
    }
    // Rows of one statement take their sequence numbers in order.
    let head = "INSERT INTO events (at, job, team, kind, message)";
    inserts(&mut out, &mut placeholders, head, "", &batch.events, |e| {
        [
            Int(e.at as i64),
            MaybeInt(e.job.map(|j| j as i64)),
            Text(&e.team),
            Text(&e.kind),
            Text(&e.message),
        ]
    });
    let head = "INSERT INTO audit (at, actor, action, target, detail)";
    inserts(&mut out, &mut placeholders, head, "", &batch.audit, |a| {
        [
            Int(a.at as i64),
            Text(&a.actor),
            Text(&a.action),
            Text(&a.target),
            Text(&a.detail),
        ]
    });
    let head = "INSERT INTO logs (job, attempt, grp, idx, stream, offset_bytes, text)";
    inserts(&mut out, &mut placeholders, head, "", &batch.logs, |l| {
        [
            Int(l.job as i64),
            Int(i64::from(l.attempt)),
            Int(i64::from(l.group)),
            Int(i64::from(l.index)),
            Text(&l.stream),
            Int(l.offset as i64),
            Text(&l.text),
        ]
    });
    out
}

/// Statements that insert `rows`, [`ROWS_PER_STATEMENT`] a statement:
/// `head`, the rows' values (`N` a row, by `row`), then `tail`.
fn inserts<'r, 'a, T, const N: usize>(
    out: &mut Vec<(String, Vec<Value<'a>>)>,
    placeholders: &mut impl FnMut(usize, usize) -> String,
    head: &str,
    tail: &str,
    rows: &'r [T],
    row: impl Fn(&'r T) -> [Value<'a>; N],
) {
    for chunk in rows.chunks(ROWS_PER_STATEMENT) {
        let sql = format!("{head} VALUES {}{tail}", placeholders(chunk.len(), N));
        out.push((sql, chunk.iter().flat_map(&row).collect()));
    }
}

/// A batch's puts by table, each key once with its last record: what
/// upserting them one after another would leave. (One statement may not
/// upsert a key twice on PostgreSQL.)
fn latest_puts(put: &[Record]) -> Vec<(Table, Vec<&Record>)> {
    let mut last: HashMap<(Table, &str), usize> = HashMap::with_capacity(put.len());
    for (i, r) in put.iter().enumerate() {
        last.insert((r.table, r.key.as_str()), i);
    }
    let mut by_table: Vec<(Table, Vec<&Record>)> = Vec::new();
    for (i, r) in put.iter().enumerate() {
        if last[&(r.table, r.key.as_str())] != i {
            continue;
        }
        match by_table.iter_mut().find(|(t, _)| *t == r.table) {
            Some((_, rows)) => rows.push(r),
            None => by_table.push((r.table, vec![r])),
        }
    }
    by_table
}

/// The SQL store, over SQLite or PostgreSQL.
pub struct SqlStore {
    pool: AnyPool,
    backend: &'static str,
    /// The leadership token every commit carries ([`Store::fence`]).
    fence: std::sync::OnceLock<u64>,
    /// SQLite's checkpoints, run beside the commits ([`checkpoints`]).
    checkpointer: Option<tokio::task::AbortHandle>,
}

impl Drop for SqlStore {
    fn drop(&mut self) {
        if let Some(c) = &self.checkpointer {
            c.abort();
        }
    }
}

/// How often SQLite's write-ahead log is copied back into the database.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// Copies SQLite's write-ahead log back into the database every
/// [`CHECKPOINT_EVERY`], beside the commits. Left to SQLite, the commit
/// that found the log past 1,000 pages copied it, with a flush of the
/// database file, and the submissions grouped behind it waited. A passive
/// checkpoint waits for no reader and no writer; what it cannot copy yet
/// it copies next time.
async fn checkpoints(pool: AnyPool) {
    loop {
        tokio::time::sleep(CHECKPOINT_EVERY).await;
        if pool.is_closed() {
            return;
        }
        if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
            .fetch_all(&pool)
            .await
        {
            tracing::warn!(error = %e, "a checkpoint of the SQLite log failed; the next one retries");
        }
    }
}

/// Opens (creating a SQLite file when needed) and migrates a store.
/// `sqlite://PATH` or `postgres://USER@HOST:PORT/DB`.
///
/// # Errors
/// On a URL of another database, a connection failure or a failed migration.
pub async fn open(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    Ok(Arc::new(SqlStore::open(url).await?))
}

impl SqlStore {
    /// The records of a table in key order: only `team`'s with `Some`,
    /// only those with keys after `after` with `Some`, at most `limit`.
    async fn load_where(
        &self,
        table: Table,
        team: Option<&str>,
        after: Option<&str>,
        limit: Option<u32>,
    ) -> Result<Vec<Record>, StoreError> {
        let mut filter = Vec::new();
        if team.is_some() {
            filter.push(format!("team = ${}", filter.len() + 1));
        }
        if after.is_some() {
            filter.push(format!("key > ${}", filter.len() + 1));
        }
        let filter = if filter.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", filter.join(" AND "))
        };
        let limit = limit.map(|n| format!(" LIMIT {n}")).unwrap_or_default();
        let sql = format!(
            "SELECT key, team, state, doc FROM {}{filter} ORDER BY key{limit}",
            table.name()
        );
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        if let Some(t) = team {
            q = q.bind(t);
        }
        if let Some(a) = after {
            q = q.bind(a);
        }
        let rows = q.fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                Ok(Record {
                    table,
                    key: r.try_get(0)?,
                    team: r.try_get(1)?,
                    state: r.try_get(2)?,
                    doc: r.try_get(3)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// The database's clock in Unix seconds, as SQL: leases are timed by
    /// the one clock every server shares.
    fn db_now(&self) -> &'static str {
        if self.backend == "sqlite" {
            "CAST(strftime('%s', 'now') AS BIGINT)"
        } else {
            "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS BIGINT)"
        }
    }

    /// See [`open`].
    ///
    /// # Errors
    /// As [`open`].
    pub async fn open(url: &str) -> Result<SqlStore, StoreError> {
        sqlx::any::install_default_drivers();
        let (backend, url, max) = if let Some(path) = url.strip_prefix("sqlite://") {
            // Create the file if it does not exist.
            let sep = if path.contains('?') { '&' } else { '?' };
            ("sqlite", format!("sqlite://{path}{sep}mode=rwc"), 4)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            ("postgres", url.to_string(), 8)
        } else {
            return Err(StoreError::BadUrl(url.to_string()));
        };
        let opts = AnyConnectOptions::from_str(&url)?;
        let pool = AnyPoolOptions::new()
            .max_connections(max)
            // A PostgreSQL connection that sat idle may have been cut (the
            // database restarted, a proxy timed it out): it is checked
            // before use, and a dead one replaced. One used within the
            // last second is not: under load that check was one of a
            // group commit's two round trips. A SQLite connection is a
            // file this process holds: nothing breaks it between uses.
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                Box::pin(async move {
                    if backend != "sqlite" && meta.idle_for > CHECK_IDLE_AFTER {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if backend == "sqlite" {
                        // WAL for concurrent readers; FULL so an acknowledged
                        // commit survives a crash of the machine, not only of
                        // the process; wait for locks instead of failing.
                        conn.execute("PRAGMA journal_mode=WAL").await?;
                        conn.execute("PRAGMA synchronous=FULL").await?;
                        conn.execute("PRAGMA busy_timeout=10000").await?;
                        // Checkpoints run beside the commits ([`checkpoints`]).
                        conn.execute("PRAGMA wal_autocheckpoint=0").await?;
                    }
                    Ok(())
                })
            })
            .connect_with(opts)
            .await?;
        migrate::run(&pool, backend).await?;
        let checkpointer =
            (backend == "sqlite").then(|| tokio::spawn(checkpoints(pool.clone())).abort_handle());
        Ok(SqlStore {
            pool,
            backend,
            fence: std::sync::OnceLock::new(),
            checkpointer,
        })
    }
}

#[async_trait]
impl Store for SqlStore {
    fn backend(&self) -> &'static str {
        self.backend
    }

    async fn load(&self, table: Table) -> Result<Vec<Record>, StoreError> {
        self.load_where(table, None, None, None).await
    }

    async fn load_page(
        &self,
        table: Table,
        team: Option<&str>,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Record>, StoreError> {
        self.load_where(table, team, after, Some(limit)).await
    }

    async fn get_many(&self, table: Table, keys: &[String]) -> Result<Vec<Record>, StoreError> {
        let mut out = Vec::with_capacity(keys.len());
        // In chunks, well under both databases' limits on bound parameters.
        for chunk in keys.chunks(500) {
            let marks = placeholders(self.backend, 1, chunk.len());
            let sql = format!(
                "SELECT key, team, state, doc FROM {} WHERE key IN {marks} ORDER BY key",
                table.name(),
            );
            let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
            for k in chunk {
                q = q.bind(k);
            }
            for r in q.fetch_all(&self.pool).await? {
                out.push(Record {
                    table,
                    key: r.try_get(0)?,
                    team: r.try_get(1)?,
                    state: r.try_get(2)?,
                    doc: r.try_get(3)?,
                });
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    async fn commit(&self, batch: &Batch) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        // Many rows a statement: each statement is a round trip to the
        // database (or to SQLite's worker thread), which dominated the
        // commit of a cycle that admits thousands of jobs. A small
        // batch's statements go in one round trip: on SQLite joined in
        // one string, on PostgreSQL (which takes one statement with
        // parameters a message) as data-modifying `WITH` clauses of one
        // statement. Those see one snapshot and may not change one row
        // twice, so a batch that deletes is not joined there; nor are
        // they run in order, so one whose events, audit lines or log
        // pieces take more than one statement (their sequence numbers
        // follow the order rows were written in) is not either.
        let sqlite = self.backend == "sqlite";
        let in_one = |rows: usize| rows <= ROWS_PER_STATEMENT;
        let joinable = sqlite
            || (batch.delete.is_empty()
                && in_one(batch.events.len())
                && in_one(batch.audit.len())
                && in_one(batch.logs.len()));
        let mut statements = statements(self.backend, batch, joinable && !sqlite);
        let join = joinable && statements.len() <= JOINED_STATEMENTS;
        if !join && joinable && !sqlite {
            statements = self::statements(self.backend, batch, false);
        }
        let fence = self.fence.get().copied();
        if join && !sqlite && fence.is_none() {
            // One statement is a transaction of its own.
            return Ok(bind_all(
                sqlx::query(sqlx::AssertSqlSafe(with_clauses(&statements))),
                statements.iter().flat_map(|(_, v)| v),
            )
            .execute(&self.pool)
            .await
            .map(|_| ())?);
        }
        let mut tx = self.pool.begin().await?;
        if let Some(token) = fence {
            // Locks the lease's row until the commit: a takeover waits for
            // it, and a commit after a takeover finds another token.
            let held = sqlx::query("UPDATE leader SET token = token WHERE id = 1 AND token = $1")
                .bind(token as i64)
                .execute(&mut *tx)
                .await?;
            if held.rows_affected() != 1 {
                return Err(StoreError::Fenced { token });
            }
        }
        if join {
            let sql = if sqlite {
                let sql: Vec<&str> = statements.iter().map(|(sql, _)| sql.as_str()).collect();
                sql.join(";\n")
            } else {
                with_clauses(&statements)
            };
            bind_all(
                sqlx::query(sqlx::AssertSqlSafe(sql)),
                statements.iter().flat_map(|(_, v)| v),
            )
            .execute(&mut *tx)
            .await?;
        } else {
            for (sql, values) in statements {
                bind_all(sqlx::query(sqlx::AssertSqlSafe(sql)), &values)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    async fn acquire_lease(
        &self,
        holder: &str,
        addr: &str,
        ttl_s: u64,
    ) -> Result<Result<u64, Leader>, StoreError> {
        let now = self.db_now();
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO leader (id, holder, addr, token, expires) VALUES (1, '', '', 0, 0) ON CONFLICT (id) DO NOTHING",
        )
        .execute(&mut *tx)
        .await?;
        let sql = format!(
            "UPDATE leader SET holder = $1, addr = $2, token = token + 1, expires = {now} + $3 WHERE id = 1 AND expires < {now}"
        );
        let took = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(holder)
            .bind(addr)
            .bind(ttl_s.min(i64::MAX as u64) as i64)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        let leader = self
            .leader()
            .await?
            .ok_or(StoreError::Db(sqlx::Error::RowNotFound))?;
        if took.rows_affected() == 1 && leader.holder == holder {
            Ok(Ok(leader.token))
        } else {
            Ok(Err(leader))
        }
    }

    async fn renew_lease(&self, token: u64, ttl_s: u64) -> Result<bool, StoreError> {
        let now = self.db_now();
        let sql = format!("UPDATE leader SET expires = {now} + $1 WHERE id = 1 AND token = $2");
        let r = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(ttl_s.min(i64::MAX as u64) as i64)
            .bind(token as i64)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() == 1)
    }

    async fn release_lease(&self, token: u64) -> Result<(), StoreError> {
        sqlx::query("UPDATE leader SET expires = 0 WHERE id = 1 AND token = $1")
            .bind(token as i64)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn leader(&self) -> Result<Option<Leader>, StoreError> {
        let now = self.db_now();
        let sql = format!("SELECT holder, addr, token, expires - {now} FROM leader WHERE id = 1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| {
            Ok(Leader {
                holder: r.try_get(0)?,
                addr: r.try_get(1)?,
                token: r.try_get::<i64, _>(2)? as u64,
                expires_in: r.try_get(3)?,
            })
        })
        .transpose()
        .map_err(|e: sqlx::Error| StoreError::from(e))
    }

    fn fence(&self, token: u64) {
        let _ = self.fence.set(token);
    }

    async fn events(&self, q: &EventQuery) -> Result<Vec<StoredEvent>, StoreError> {
        let mut sql =
            String::from("SELECT seq, at, job, team, kind, message FROM events WHERE seq > $1");
        let mut n = 1;
        if q.job.is_some() {
            n += 1;
            sql.push_str(&format!(" AND job = ${n}"));
        }
        if q.team.is_some() {
            n += 1;
            sql.push_str(&format!(" AND team = ${n}"));
        }
        if q.since.is_some() {
            n += 1;
            sql.push_str(&format!(" AND at >= ${n}"));
        }
        if q.until.is_some() {
            n += 1;
            sql.push_str(&format!(" AND at < ${n}"));
        }
        let order = if q.newest { "DESC" } else { "ASC" };
        sql.push_str(&format!(" ORDER BY seq {order} LIMIT ${}", n + 1));
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(q.after);
        if let Some(j) = q.job {
            query = query.bind(j as i64);
        }
        if let Some(t) = &q.team {
            query = query.bind(t.clone());
        }
        for t in [q.since, q.until].into_iter().flatten() {
            query = query.bind(t.min(i64::MAX as u64) as i64);
        }
        let mut rows = query
            .bind(q.limit.clamp(1, 10_000))
            .fetch_all(&self.pool)
            .await?;
        if q.newest {
            rows.reverse();
        }
        rows.iter()
            .map(|r| {
                Ok(StoredEvent {
                    seq: r.try_get(0)?,
                    event: NewEvent {
                        at: r.try_get::<i64, _>(1)? as u64,
                        job: r.try_get::<Option<i64>, _>(2)?.map(|j| j as u64),
                        team: r.try_get(3)?,
                        kind: r.try_get(4)?,
                        message: r.try_get(5)?,
                    },
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    async fn audit(&self, after: i64, limit: i64) -> Result<Vec<StoredAudit>, StoreError> {
        let rows = sqlx::query(
            "SELECT seq, at, actor, action, target, detail FROM audit WHERE seq > $1 ORDER BY seq LIMIT $2",
        )
        .bind(after)
        .bind(limit.clamp(1, 10_000))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(StoredAudit {
                    seq: r.try_get(0)?,
                    entry: NewAudit {
                        at: r.try_get::<i64, _>(1)? as u64,
                        actor: r.try_get(2)?,
                        action: r.try_get(3)?,
                        target: r.try_get(4)?,
                        detail: r.try_get(5)?,
                    },
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    async fn logs(&self, job: u64, attempt: Option<u32>) -> Result<Vec<LogPiece>, StoreError> {
        let sql = if attempt.is_some() {
            "SELECT attempt, grp, idx, stream, offset_bytes, text FROM logs WHERE job = $1 AND attempt = $2 ORDER BY seq"
        } else {
            "SELECT attempt, grp, idx, stream, offset_bytes, text FROM logs WHERE job = $1 ORDER BY seq"
        };
        let mut q = sqlx::query(sql).bind(job as i64);
        if let Some(a) = attempt {
            q = q.bind(i64::from(a));
        }
        let rows = q.fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                Ok(LogPiece {
                    job,
                    attempt: r.try_get::<i64, _>(0)? as u32,
                    group: r.try_get::<i64, _>(1)? as u16,
                    index: r.try_get::<i64, _>(2)? as u32,
                    stream: r.try_get(3)?,
                    offset: r.try_get::<i64, _>(4)? as u64,
                    text: r.try_get(5)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }
}
