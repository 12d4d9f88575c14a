//! `report.json`'s `via_outbox` (`--via-outbox`): how a run's payments went through the outbox
//! table and the relay, and what the topic holds of them ([`outbox::census`]).

use crate::outbox;
use crate::produce::Kind;
use crate::{Produced, Session, Spec};

/// `report.json`'s `via_outbox`: how the run's payments went through the outbox and the relay.
#[derive(Debug, serde::Serialize)]
pub struct ViaOutbox {
    event_type: &'static str,
    /// Rows committed: payments and double taps (these count as sent and acked).
    rows_committed: u64,
    /// Rows of batches that failed (not counted as sent).
    rows_failed: u64,
    /// Records loadgen produced straight to Kafka and the broker acknowledged: redrives and
    /// poison.
    direct_records: u64,
    /// Rows the relay had not published when loadgen stopped waiting (None: unknown).
    unpublished: Option<i64>,
    /// `latency_ms` runs from the payment's `occurred_at` (when loadgen made it, before its
    /// row committed) to the credit, not from the record's timestamp (the relay's publish).
    latency_from: &'static str,
    /// What the topic holds of the run's rows (None: reading it back failed, said on stderr).
    topic: Option<outbox::Census>,
}

impl ViaOutbox {
    pub async fn measure(
        session: &Session,
        spec: &Spec,
        produced: &Produced,
        from: &[i64],
        unpublished: Option<i64>,
    ) -> anyhow::Result<ViaOutbox> {
        let rows = produced.log.iter().filter(|s| s.outbox);
        let direct = produced.log.iter().filter(|s| !s.outbox && s.acked);
        // Records expected of each committed row on the topic: the relay's, and the redrives.
        let mut expected: std::collections::HashMap<uuid::Uuid, u64> = rows
            .clone()
            .filter(|s| s.acked)
            .filter_map(|s| s.event_id.map(|id| (id, 1)))
            .collect();
        for s in direct.clone().filter(|s| s.kind == Kind::Redrive) {
            if let Some(n) = s.event_id.and_then(|id| expected.get_mut(&id)) {
                *n += 1;
            }
        }
        let to = session.watcher.highs().await?;
        let (brokers, topic, from) = (session.brokers.clone(), spec.topic.clone(), from.to_vec());
        let census = tokio::task::spawn_blocking(move || {
            outbox::census(&brokers, &topic, &from, &to, &expected)
        })
        .await?
        .inspect_err(|e| eprintln!("loadgen: {e:#}"))
        .ok();
        Ok(ViaOutbox {
            event_type: outbox::EVENT_TYPE,
            rows_committed: rows.clone().filter(|s| s.acked).count() as u64,
            rows_failed: rows.filter(|s| !s.acked).count() as u64,
            direct_records: direct.count() as u64,
            unpublished,
            latency_from: "occurred_at",
            topic: census,
        })
    }

    /// Lines for the terminal, below the summary table.
    pub fn summary(&self) -> String {
        let topic = match &self.topic {
            Some(t) => format!(
                "topic: {} records during the run, {} of them this run's rows: the relay \
                 published {} records again ({} rows), {} rows it never published",
                t.topic_records, t.row_records, t.republished, t.rows_republished, t.rows_missing
            ),
            None => "topic: not read back".into(),
        };
        format!(
            "via the outbox: {} rows committed ({} failed), {} records straight to Kafka \
             (redrives, poison); latency from the payment's occurred_at\n{topic}",
            self.rows_committed, self.rows_failed, self.direct_records,
        )
    }
}
