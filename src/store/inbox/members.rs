//! `inbox_members`: the processes whose processors work on one consumer's inbox (see
//! [`crate::inbox::members`]).

use tokio_postgres::GenericClient;
use uuid::Uuid;

use crate::store::StoreError;

const BEAT: &str = "\
INSERT INTO inbox_members (consumer, member, processors, worker) VALUES ($1, $2, $3, $4)
ON CONFLICT (consumer, member) DO UPDATE SET beat_at = now(), processors = EXCLUDED.processors";

const FORGET_DEAD: &str = "\
DELETE FROM inbox_members WHERE consumer = $1 AND beat_at < now() - $2 * interval '1 millisecond'";

const LIVE: &str = "\
SELECT member, processors FROM inbox_members WHERE consumer = $1 ORDER BY joined_at, member";

/// Beats for `member` (registering it on its first beat), deletes the members whose last beat
/// is older than `ttl_ms`, and returns the live members with their processor counts, in the
/// order their slices are numbered (oldest member first).
pub async fn beat<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    member: Uuid,
    worker: &str,
    processors: i32,
    ttl_ms: f64,
) -> Result<Vec<(Uuid, i32)>, StoreError> {
    client
        .execute(BEAT, &[&consumer, &member, &processors, &worker])
        .await?;
    client.execute(FORGET_DEAD, &[&consumer, &ttl_ms]).await?;
    let rows = client.query(LIVE, &[&consumer]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// A member leaving on purpose: the others take its slices at their next beat.
pub async fn leave<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    member: Uuid,
) -> Result<(), StoreError> {
    client
        .execute(
            "DELETE FROM inbox_members WHERE consumer = $1 AND member = $2",
            &[&consumer, &member],
        )
        .await?;
    Ok(())
}
