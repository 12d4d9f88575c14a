//! One payment's records as the generator draws them: the original, and the resend, redrive,
//! double tap or poison it draws with the mix's odds, each with the [`Sent`] that logs it.

use uuid::Uuid;

use super::{Kind, Mix, Run, Sent};

pub(super) struct Record {
    pub(super) key: String,
    pub(super) payload: Vec<u8>,
    pub(super) event_id: Option<String>,
    /// The `event_type` header, as the relay sets it (only on a redrive of an outbox row).
    pub(super) event_type: Option<&'static str>,
    /// More headers (a CloudEvent's, see [`super::shape`]).
    pub(super) headers: Vec<(&'static str, String)>,
    pub(super) sent: Sent,
}

/// A payment and what it drew: the original and each duplicate or poison record.
pub(super) struct Draw {
    pub(super) original: Record,
    pub(super) resend: Option<Record>,
    pub(super) redrive: Option<Record>,
    pub(super) double_tap: Option<Record>,
    pub(super) poison: Option<Record>,
}

/// One more payment and what it draws, in the order the generator has always drawn them (so a
/// seed draws the same payments and duplicates with or without the outbox, in any format).
/// `registry`: poison of the kinds a registry format meets ([`registry_poison`]); the records
/// are JSON still, [`super::wire`] encodes them.
pub(super) fn draw(
    run: &Run,
    mix: &Mix,
    rng: &mut fastrand::Rng,
    seq: &mut u64,
    registry: bool,
) -> Draw {
    *seq += 1;
    let n = *seq;
    let user_id = format!("u_{}_{}", run.id, rng.u64(0..run.users.max(1)));
    let payment_id = format!("{}{n}", run.payment_prefix());
    let amount_paise = 100 * rng.i64(1..=5_000);
    let original = payment_record(run, &payment_id, &user_id, amount_paise, Kind::Original);
    let resend = (rng.f64() < mix.resend).then(|| copy_as(&original, Kind::Resend));
    let redrive = (rng.f64() < mix.redrive).then(|| copy_as(&original, Kind::Redrive));
    let double_tap = (rng.f64() < mix.double_tap)
        .then(|| payment_record(run, &payment_id, &user_id, amount_paise, Kind::DoubleTap));
    let poison = (rng.f64() < mix.poison).then(|| match registry {
        false => poison(run, n, &user_id, rng.bool()),
        true => registry_poison(run, n, &user_id, rng.bool()),
    });
    Draw {
        original,
        resend,
        redrive,
        double_tap,
        poison,
    }
}

fn payment_record(
    run: &Run,
    payment_id: &str,
    user_id: &str,
    amount_paise: i64,
    kind: Kind,
) -> Record {
    let event_id = uuid::Uuid::now_v7();
    let text = run.ids.text(event_id);
    let payload = payment_json(&text, payment_id, user_id, amount_paise);
    Record {
        key: user_id.to_string(),
        payload,
        event_id: Some(text),
        event_type: None,
        headers: Vec::new(),
        sent: Sent {
            kind,
            payment_id: Some(payment_id.to_string()),
            user_id: user_id.to_string(),
            amount_paise,
            event_id: Some(event_id),
            outbox: false,
            acked: false,
            acked_at_s: 0.0,
            partition: None,
        },
    }
}

/// The JSON demo's payment object: what the engine's registry formats decode into too.
fn payment_json(event_id: &str, payment_id: &str, user_id: &str, amount_paise: i64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "event_id": event_id,
        "payment_id": payment_id,
        "user_id": user_id,
        "amount_paise": amount_paise,
        "occurred_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
    }))
    .expect("a JSON object serialises")
}

fn copy_as(r: &Record, kind: Kind) -> Record {
    Record {
        key: r.key.clone(),
        payload: r.payload.clone(),
        event_id: r.event_id.clone(),
        event_type: r.event_type,
        headers: r.headers.clone(),
        sent: Sent {
            kind,
            ..r.sent.clone()
        },
    }
}

/// Poison that names its run inside the bytes, so the verifier can tell this run's dead
/// letters (and failed inbox rows) from others'. Half of it is undecodable; of the rest, odd
/// payments' poison has no event id and even ones' has an id but no payment fields (decided by
/// `n`, not by the random generator, so a seed draws the same amounts, users and duplicates
/// as before this kind existed).
fn poison(run: &Run, n: u64, user_id: &str, undecodable: bool) -> Record {
    let (payload, event_id, kind) = if undecodable {
        (
            format!("\u{1}not json: loadgen run {} poison {n}", run.id).into_bytes(),
            Some(Uuid::now_v7()),
            Kind::PoisonUndecodable,
        )
    } else if n % 2 == 1 {
        (
            serde_json::to_vec(&serde_json::json!({"loadgen_run": run.id, "poison": n}))
                .expect("json"),
            None,
            Kind::PoisonNoEventId,
        )
    } else {
        // A valid event id and JSON, but no payment_id or amount: stored by an inbox receiver,
        // refused by the handler's check.
        (
            serde_json::to_vec(&serde_json::json!({
                "loadgen_run": run.id,
                "poison": n,
                "user_id": user_id,
                "amount_paise": "not a number",
            }))
            .expect("json"),
            Some(Uuid::now_v7()),
            Kind::PoisonBadField,
        )
    };
    poison_record(user_id, kind, payload, event_id)
}

/// A poison record of `kind` to `user_id`'s key: no payment, `event_id` its header if any.
fn poison_record(user_id: &str, kind: Kind, payload: Vec<u8>, event_id: Option<Uuid>) -> Record {
    Record {
        key: user_id.to_string(),
        sent: Sent {
            kind,
            payment_id: None,
            user_id: user_id.to_string(),
            amount_paise: 0,
            event_id,
            outbox: false,
            acked: false,
            acked_at_s: 0.0,
            partition: None,
        },
        payload,
        event_id: event_id.map(|id| id.to_string()),
        event_type: None,
        headers: Vec::new(),
    }
}

/// Poison for a registry format, drawn with the same odds as [`poison`] and named by its run the
/// same way (the run id is in the bytes). Half of it cannot be decoded: in turn (by `n`) no
/// magic byte, a schema id the registry does not know, or bytes that do not fit the schema
/// ([`super::wire`] frames them). The other half is a well-formed payment the handler must
/// refuse: odd payments' without an `event_id` header, even ones' with a negative amount. Its
/// payment id (`poison_<run>_<n>`) tells it from the run's payments.
fn registry_poison(run: &Run, n: u64, user_id: &str, undecodable: bool) -> Record {
    let marker = || {
        serde_json::to_vec(&serde_json::json!({"loadgen_run": run.id, "poison": n})).expect("json")
    };
    let event_id = Uuid::now_v7();
    let (payload, event_id, kind) = match (undecodable, n % 3) {
        (true, 0) => (
            format!("\u{1}no magic byte: loadgen run {} poison {n}", run.id).into_bytes(),
            Some(event_id),
            Kind::PoisonUndecodable,
        ),
        (true, 1) => (marker(), Some(event_id), Kind::PoisonUnknownSchema),
        (true, _) => (marker(), Some(event_id), Kind::PoisonSchemaMismatch),
        (false, _) => {
            let payment_id = format!("poison_{}_{n}", run.id);
            if n % 2 == 1 {
                let payload = payment_json(&event_id.to_string(), &payment_id, user_id, 100);
                (payload, None, Kind::PoisonNoEventId)
            } else {
                let payload = payment_json(&event_id.to_string(), &payment_id, user_id, -100);
                (payload, Some(event_id), Kind::PoisonBadField)
            }
        }
    };
    poison_record(user_id, kind, payload, event_id)
}
