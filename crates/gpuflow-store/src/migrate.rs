//! Schema migrations: numbered, applied in order, each in its own
//! transaction, recorded in `schema_migrations`. A migration is never edited
//! once released; a change is a new number.

use sqlx::AnyPool;

use crate::StoreError;

/// `(version, statements)`; `{ID}` becomes the dialect's auto-increment key.
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
    "CREATE TABLE teams (key TEXT PRIMARY KEY CHECK (length(key) > 0), team TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL);
     CREATE TABLE users (key TEXT PRIMARY KEY CHECK (length(key) > 0), team TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL);
     CREATE TABLE tokens (key TEXT PRIMARY KEY CHECK (length(key) > 0), team TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL);
     CREATE TABLE queues (key TEXT PRIMARY KEY CHECK (length(key) > 0), team TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL);
     CREATE TABLE nodes (key TEXT PRIMARY KEY CHECK (length(key) > 0), team TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL);
     CREATE TABLE jobs (key TEXT PRIMARY KEY CHECK (length(key) > 0), team TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL);
     CREATE INDEX jobs_team_state ON jobs (team, state);
     CREATE TABLE meta (key TEXT PRIMARY KEY CHECK (length(key) > 0), team TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL);
     CREATE TABLE events (seq {ID}, at BIGINT NOT NULL, job BIGINT, team TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL);
     CREATE INDEX events_job ON events (job, seq);
     CREATE TABLE audit (seq {ID}, at BIGINT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, target TEXT NOT NULL, detail TEXT NOT NULL)",
    ),
    (
        2,
        "CREATE TABLE projects (key TEXT PRIMARY KEY CHECK (length(key) > 0), team TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL)",
    ),
    (
        3,
        "CREATE TABLE logs (seq {ID}, job BIGINT NOT NULL, attempt BIGINT NOT NULL, grp BIGINT NOT NULL, idx BIGINT NOT NULL, stream TEXT NOT NULL, offset_bytes BIGINT NOT NULL, text TEXT NOT NULL);
     CREATE INDEX logs_job ON logs (job, attempt, seq)",
    ),
    (
        4,
        "CREATE TABLE leader (id BIGINT PRIMARY KEY, holder TEXT NOT NULL, addr TEXT NOT NULL, token BIGINT NOT NULL, expires BIGINT NOT NULL)",
    ),
];

pub(crate) async fn run(pool: &AnyPool, backend: &str) -> Result<(), StoreError> {
    sqlx::query("CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY)")
        .execute(pool)
        .await?;
    let id = if backend == "sqlite" {
        "INTEGER PRIMARY KEY AUTOINCREMENT"
    } else {
        "BIGSERIAL PRIMARY KEY"
    };
    for &(version, sql) in MIGRATIONS {
        let fail = |source| StoreError::Migration { version, source };
        let mut tx = pool.begin().await.map_err(fail)?;
        if backend == "postgres" {
            // Servers that start together on one database migrate one at
            // a time.
            sqlx::query("SELECT pg_advisory_xact_lock(7426539)")
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        let done: Option<i64> =
            sqlx::query_scalar("SELECT version FROM schema_migrations WHERE version = $1")
                .bind(version)
                .fetch_optional(&mut *tx)
                .await
                .map_err(fail)?;
        if done.is_some() {
            continue;
        }
        for stmt in sql.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            sqlx::query(sqlx::AssertSqlSafe(stmt.replace("{ID}", id)))
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        sqlx::query("INSERT INTO schema_migrations (version) VALUES ($1)")
            .bind(version)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
    }
    Ok(())
}
