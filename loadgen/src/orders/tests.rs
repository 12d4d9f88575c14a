//! The unit tests of `loadgen orders`: the stream's disorder, the chain check and the verifier.

use std::collections::HashMap;

use uuid::Uuid;

use super::stream::{plan, Kind, Record, Shape};
use super::verify::{chain_break, check, Expected, Move, Observed};

fn shape() -> Shape {
    Shape {
        orders: 50,
        versions: 6,
        stale: 0.2,
        duplicates: 0.05,
        window: 24,
    }
}

#[test]
fn the_stream_is_out_of_order_with_stale_copies_after_the_newest() {
    let records = plan("t", &shape(), &mut fastrand::Rng::with_seed(3));
    let originals: Vec<&Record> = records
        .iter()
        .filter(|r| r.kind == Kind::Original)
        .collect();
    assert_eq!(originals.len(), 300);
    // Some order has a later version before an earlier one.
    let mut seen: HashMap<&str, i64> = HashMap::new();
    let mut inversions = 0;
    for r in &originals {
        let top = seen.entry(r.order.as_str()).or_insert(0);
        if r.version < *top {
            inversions += 1;
        }
        *top = (*top).max(r.version);
    }
    assert!(inversions > 30, "only {inversions} versions out of order");
    // Every stale copy comes after every original of its order, with a new id and the
    // same bytes; a duplicate is the same record.
    for (i, r) in records.iter().enumerate() {
        match r.kind {
            Kind::Original => {}
            Kind::Stale => {
                assert!(records[i..]
                    .iter()
                    .all(|o| o.kind != Kind::Original || o.order != r.order));
                let original = records
                    .iter()
                    .find(|o| {
                        o.kind == Kind::Original && o.order == r.order && o.version == r.version
                    })
                    .unwrap();
                assert_ne!(original.event_id, r.event_id);
                assert_eq!(original.payload, r.payload);
            }
            Kind::Duplicate => {
                let original = records[..i]
                    .iter()
                    .find(|o| o.kind == Kind::Original && o.event_id == r.event_id)
                    .unwrap();
                assert_eq!((&original.key, &original.payload), (&r.key, &r.payload));
            }
        }
    }
    let stale = records.iter().filter(|r| r.kind == Kind::Stale).count();
    assert!((30..=90).contains(&stale), "{stale} stale copies");
}

fn moves(chain: &[(Option<i64>, i64)]) -> Vec<Move> {
    chain
        .iter()
        .enumerate()
        .map(|(i, (from, to))| Move {
            id: i as i64 + 1,
            status: "S".into(),
            from: *from,
            to: *to,
            message_id: Uuid::nil(),
        })
        .collect()
}

#[test]
fn a_chain_must_start_from_nothing_and_only_rise() {
    assert_eq!(chain_break(&moves(&[(None, 2), (Some(2), 6)]), false), None);
    assert!(chain_break(&moves(&[(Some(1), 2)]), false).is_some());
    assert!(chain_break(&moves(&[(None, 4), (Some(4), 3)]), false).is_some());
    assert!(chain_break(&moves(&[(None, 4), (Some(4), 4)]), false).is_some());
    assert!(chain_break(&moves(&[(None, 2), (Some(3), 5)]), false).is_some());
    // Delta: every version, one at a time.
    assert_eq!(chain_break(&moves(&[(None, 1), (Some(1), 2)]), true), None);
    assert!(chain_break(&moves(&[(None, 2), (Some(2), 6)]), true).is_some());
    assert!(chain_break(&moves(&[(None, 1), (Some(1), 3)]), true).is_some());
}

#[test]
fn the_verifier_passes_a_right_ledger_and_names_a_regression() {
    let records = plan("t", &shape(), &mut fastrand::Rng::with_seed(5));
    let acked = vec![true; records.len()];
    let expected = Expected::from(&records, &acked);
    // The engine applied version 2, then the newest, of every order.
    let mut observed = Observed::default();
    let id_of = |order: &str, version: i64| {
        records
            .iter()
            .find(|r| r.order == order && r.version == version)
            .unwrap()
            .event_id
    };
    for order in expected.newest.keys() {
        let status = |v: i64| expected.statuses[&(order.clone(), v)].to_string();
        observed.view.insert(order.clone(), (status(6), 6));
        observed.stored.insert(order.clone(), 6);
        observed.history.insert(
            order.clone(),
            vec![
                Move {
                    id: 1,
                    status: status(2),
                    from: None,
                    to: 2,
                    message_id: id_of(order, 2),
                },
                Move {
                    id: 2,
                    status: status(6),
                    from: Some(2),
                    to: 6,
                    message_id: id_of(order, 6),
                },
            ],
        );
    }
    let v = check(&expected, &observed, false);
    assert!(v.verified(), "{v:?}");
    assert_eq!((v.at_newest, v.moves), (50, 100));

    // "PAID after REFUNDED": a stale copy of version 2 applied over version 6.
    let order = expected.newest.keys().next().unwrap().clone();
    let paid = expected.statuses[&(order.clone(), 2)].to_string();
    observed.history.get_mut(&order).unwrap().push(Move {
        id: 3,
        status: paid.clone(),
        from: Some(6),
        to: 2,
        message_id: id_of(&order, 2),
    });
    observed.view.insert(order.clone(), (paid, 2));
    let v = check(&expected, &observed, false);
    assert!(!v.verified());
    assert_eq!(v.broken.len(), 1);
    assert_eq!(v.wrong.len(), 1);
    assert_eq!(v.stored_off.len(), 1);
    assert!(v.details(&expected, &observed).contains(&order));
}
