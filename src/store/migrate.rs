//! Schema migrations: `migrations/V<n>__<name>.sql`, embedded in the binary at build time and
//! applied once each by refinery, which records them in `refinery_schema_history`.
//!
//! refinery was picked over a hand-written runner: it is maintained, speaks tokio-postgres
//! natively, checks that applied migrations were not edited afterwards, and embeds the SQL so a
//! deployed binary needs no migrations folder next to it.

use tokio_postgres::Client;

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// An arbitrary constant: the advisory lock that serialises concurrent `migrate` runs (several
/// workers starting at once), so only one applies a migration and the others wait for it.
const MIGRATE_LOCK: i64 = 0x6566_6665_6374_0001;

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("migration lock: {0}")]
    Lock(#[source] tokio_postgres::Error),
    #[error(transparent)]
    Refinery(#[from] refinery::Error),
}

/// What one run applied.
#[derive(Debug)]
pub struct Applied {
    pub names: Vec<String>,
}

/// Applies every migration not applied yet, in order.
pub async fn run(client: &mut Client) -> Result<Applied, MigrateError> {
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATE_LOCK])
        .await
        .map_err(MigrateError::Lock)?;
    let report = embedded::migrations::runner().run_async(client).await;
    // Unlock even when a migration failed; a lost connection releases it anyway.
    let _ = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATE_LOCK])
        .await;
    let report = report?;
    Ok(Applied {
        names: report
            .applied_migrations()
            .iter()
            .map(|m| format!("V{}__{}", m.version(), m.name()))
            .collect(),
    })
}
