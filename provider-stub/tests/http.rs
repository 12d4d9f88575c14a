//! The provider stub over real HTTP: each rule of Stripe-style idempotency keys, the injected
//! faults, and the control endpoints a process run of the stub takes. No Kafka or PostgreSQL.

use std::time::{Duration, Instant};

use provider_stub::{
    Fault, FaultRate, Message, ProviderStub, Stats, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED,
};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

async fn stub() -> ProviderStub {
    ProviderStub::start("127.0.0.1:0").await.unwrap()
}

fn client() -> Client {
    // A proxy from the environment must not sit between a test and its local stub.
    Client::builder().no_proxy().build().unwrap()
}

/// `POST /v1/messages` under `key`; returns the status, whether it was a replay, and the body.
async fn send(client: &Client, stub: &ProviderStub, key: &str, body: &Value) -> Answer {
    let response = client
        .post(format!("{}/v1/messages", stub.url()))
        .header(IDEMPOTENCY_KEY, key)
        .json(body)
        .send()
        .await
        .unwrap();
    Answer::read(response).await
}

async fn lookup(client: &Client, stub: &ProviderStub, key: &str) -> Answer {
    let response = client
        .get(format!("{}/v1/messages", stub.url()))
        .query(&[("idempotency_key", key)])
        .send()
        .await
        .unwrap();
    Answer::read(response).await
}

async fn control(client: &Client, stub: &ProviderStub, path: &str, body: &Value) -> Answer {
    let response = client
        .post(format!("{}/control/{path}", stub.url()))
        .json(body)
        .send()
        .await
        .unwrap();
    Answer::read(response).await
}

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: Value,
}

impl Answer {
    async fn read(response: reqwest::Response) -> Answer {
        let status = response.status();
        let replayed = response
            .headers()
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|value| value == "true");
        let body = response.json().await.unwrap();
        Answer {
            status,
            replayed,
            body,
        }
    }

    fn error_type(&self) -> &str {
        self.body["error"]["type"].as_str().unwrap_or_default()
    }
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn sms(to: &str) -> Value {
    json!({ "to": to, "text": "Your cashback has arrived" })
}

#[tokio::test]
async fn a_new_key_delivers_once_and_answers_200() {
    let (stub, client) = (stub().await, client());

    let answer = send(&client, &stub, "k1", &sms("u_17")).await;

    assert_eq!(answer.status, StatusCode::OK);
    assert!(!answer.replayed);
    assert_eq!(answer.body, json!({ "id": "msg_1", "status": "sent" }));
    assert_eq!(stub.effects_for("k1"), 1);
    let messages = stub.messages();
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].id, "msg_1");
    assert_eq!(messages[0].idempotency_key, "k1");
    assert_eq!(messages[0].body, sms("u_17"));
    let found = lookup(&client, &stub, "k1").await;
    assert_eq!(found.status, StatusCode::OK);
    let found: Message = serde_json::from_value(found.body).unwrap();
    assert_eq!(found, messages[0]);
    assert_eq!(stub.requests(), 1);
    assert_eq!(stub.lookups(), 1);
}

#[tokio::test]
async fn the_same_key_and_body_replays_without_a_second_delivery() {
    let (stub, client) = (stub().await, client());
    let first = send(&client, &stub, "k1", &sms("u_17")).await;

    // The same parameters in another order are the same JSON value.
    let reordered = json!({ "text": "Your cashback has arrived", "to": "u_17" });
    let again = send(&client, &stub, "k1", &reordered).await;
    let third = send(&client, &stub, "k1", &sms("u_17")).await;

    for replay in [&again, &third] {
        assert_eq!(replay.status, StatusCode::OK);
        assert!(replay.replayed);
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(stub.effects_for("k1"), 1);
    assert_eq!(stub.messages().len(), 1);
    assert_eq!(stub.replays(), 2);
    assert_eq!(stub.requests(), 3);
}

#[tokio::test]
async fn the_same_key_with_another_body_is_refused_and_not_saved() {
    let (stub, client) = (stub().await, client());
    let first = send(&client, &stub, "k1", &sms("u_17")).await;

    let other = send(&client, &stub, "k1", &sms("u_18")).await;

    assert_eq!(other.status, StatusCode::BAD_REQUEST);
    assert!(!other.replayed);
    assert_eq!(other.error_type(), "idempotency_error");
    assert_eq!(
        other.body["error"]["message"],
        "Keys for idempotent requests can only be used with the same parameters they were \
         first used with."
    );
    assert_eq!(stub.mismatches(), 1);
    assert_eq!(stub.effects_for("k1"), 1);
    // The refusal did not replace what the key saved.
    let replay = send(&client, &stub, "k1", &sms("u_17")).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, first.body);
}

#[tokio::test]
async fn a_request_while_the_key_is_in_flight_gets_409() {
    let (stub, client) = (stub().await, client());
    stub.inject(Fault::Delay(Duration::from_millis(400)));
    let first = tokio::spawn({
        let (client, url) = (client.clone(), stub.url());
        async move {
            let response = client
                .post(format!("{url}/v1/messages"))
                .header(IDEMPOTENCY_KEY, "k1")
                .json(&sms("u_17"))
                .send()
                .await
                .unwrap();
            Answer::read(response).await
        }
    });
    wait_until("the first request is in flight", || stub.in_flight() == 1).await;

    let concurrent = send(&client, &stub, "k1", &sms("u_17")).await;
    assert_eq!(concurrent.status, StatusCode::CONFLICT);
    assert_eq!(concurrent.error_type(), "idempotency_error");
    let message = concurrent.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("in progress"), "{message}");
    // Nothing was delivered yet, so the lookup a sender reconciles with finds nothing.
    assert_eq!(
        lookup(&client, &stub, "k1").await.status,
        StatusCode::NOT_FOUND
    );

    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.replayed);
    let replay = send(&client, &stub, "k1", &sms("u_17")).await;
    assert_eq!(replay.status, StatusCode::OK);
    assert!(replay.replayed);
    assert_eq!(replay.body, first.body);
    assert_eq!(stub.effects_for("k1"), 1);
    assert_eq!(stub.conflicts(), 1);
    assert_eq!(stub.in_flight(), 0);
}

#[tokio::test]
async fn a_burst_on_one_key_delivers_once() {
    let (stub, client) = (stub().await, client());
    stub.inject(Fault::Delay(Duration::from_millis(200)));

    let body = sms("u_17");
    let burst = (0..10).map(|_| send(&client, &stub, "k1", &body));
    let answers = futures::future::join_all(burst).await;

    let sent: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.status == StatusCode::OK && !a.replayed)
        .collect();
    assert_eq!(sent.len(), 1, "{answers:?}");
    for answer in &answers {
        // Those that came after the first finished replay it; the others were refused.
        match answer.status {
            StatusCode::OK => assert_eq!(answer.body, sent[0].body),
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}: {answer:?}"),
        }
    }
    assert_eq!(stub.conflicts() + stub.replays(), 9);
    assert_eq!(stub.effects_for("k1"), 1);
    assert_eq!(stub.requests(), 10);
}

#[tokio::test]
async fn fail_before_saves_the_500_and_delivers_nothing() {
    let (stub, client) = (stub().await, client());
    stub.inject(Fault::FailBefore);

    let failed = send(&client, &stub, "k1", &sms("u_17")).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(failed.error_type(), "api_error");

    let replay = send(&client, &stub, "k1", &sms("u_17")).await;
    assert_eq!(replay.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(replay.replayed);
    assert_eq!(replay.body, failed.body);
    let found = lookup(&client, &stub, "k1").await;
    assert_eq!(found.status, StatusCode::NOT_FOUND);
    assert_eq!(found.error_type(), "invalid_request_error");
    assert_eq!(stub.effects_for("k1"), 0);
    assert!(stub.messages().is_empty());
}

#[tokio::test]
async fn fail_after_saves_the_500_but_delivers() {
    let (stub, client) = (stub().await, client());
    stub.inject(Fault::FailBefore);
    let before = send(&client, &stub, "before", &sms("u_17")).await;
    stub.inject(Fault::FailAfter);

    let failed = send(&client, &stub, "k1", &sms("u_17")).await;

    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    // A client cannot tell the two failures apart; only the lookup can.
    assert_eq!(failed.body, before.body);
    let replay = send(&client, &stub, "k1", &sms("u_17")).await;
    assert_eq!(replay.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(replay.replayed);
    let found = lookup(&client, &stub, "k1").await;
    assert_eq!(found.status, StatusCode::OK);
    assert_eq!(found.body["idempotency_key"], "k1");
    assert_eq!(stub.effects_for("k1"), 1);
}

#[tokio::test]
async fn a_client_that_times_out_is_delivered_to_behind_its_back() {
    let (stub, client) = (stub().await, client());
    stub.inject(Fault::Delay(Duration::from_millis(300)));
    let impatient = Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();

    let gave_up = impatient
        .post(format!("{}/v1/messages", stub.url()))
        .header(IDEMPOTENCY_KEY, "k1")
        .json(&sms("u_17"))
        .send()
        .await
        .unwrap_err();
    assert!(gave_up.is_timeout(), "{gave_up}");
    wait_until("the abandoned request finishes", || stub.in_flight() == 0).await;

    assert_eq!(stub.effects_for("k1"), 1);
    assert_eq!(lookup(&client, &stub, "k1").await.status, StatusCode::OK);
    let retry = send(&client, &stub, "k1", &sms("u_17")).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(retry.replayed);
    assert_eq!(retry.body["id"], stub.messages()[0].id);
    assert_eq!(stub.effects_for("k1"), 1);
}

#[tokio::test]
async fn bad_requests_are_refused_and_not_saved() {
    let (stub, client) = (stub().await, client());
    let url = format!("{}/v1/messages", stub.url());

    let no_key = client.post(&url).json(&sms("u_17")).send().await.unwrap();
    let no_key = Answer::read(no_key).await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST);
    assert_eq!(no_key.error_type(), "invalid_request_error");
    let long_key = send(&client, &stub, &"k".repeat(256), &sms("u_17")).await;
    assert_eq!(long_key.status, StatusCode::BAD_REQUEST);
    let not_an_object = send(&client, &stub, "k1", &json!([1, 2])).await;
    assert_eq!(not_an_object.status, StatusCode::BAD_REQUEST);
    let not_json = client
        .post(&url)
        .header(IDEMPOTENCY_KEY, "k1")
        .body("to=u_17")
        .send()
        .await
        .unwrap();
    assert_eq!(Answer::read(not_json).await.status, StatusCode::BAD_REQUEST);

    // The key used with bad bodies is still new.
    let first = send(&client, &stub, "k1", &sms("u_17")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.replayed);
    assert_eq!(stub.requests(), 5);
    assert_eq!(stub.messages().len(), 1);
}

#[tokio::test]
async fn faults_injected_over_http_apply_in_order() {
    let (stub, client) = (stub().await, client());

    let queued = control(
        &client,
        &stub,
        "faults",
        &json!([{ "fail": "before" }, { "fail": "after" }, { "delay_ms": 200 }]),
    )
    .await;
    assert_eq!(queued.status, StatusCode::OK);
    assert_eq!(queued.body, json!({ "queued": 3 }));
    let refused = control(&client, &stub, "faults", &json!([{ "fail": "during" }])).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);

    let before = send(&client, &stub, "k1", &sms("u_1")).await;
    let after = send(&client, &stub, "k2", &sms("u_2")).await;
    let started = Instant::now();
    let delayed = send(&client, &stub, "k3", &sms("u_3")).await;
    let plain = send(&client, &stub, "k4", &sms("u_4")).await;

    assert_eq!(before.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(after.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(delayed.status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(plain.status, StatusCode::OK);
    let keys: Vec<usize> = ["k1", "k2", "k3", "k4"]
        .iter()
        .map(|key| stub.effects_for(key))
        .collect();
    assert_eq!(keys, [0, 1, 1, 1]);

    let stats = client
        .get(format!("{}/control/stats", stub.url()))
        .send()
        .await
        .unwrap();
    let stats: Stats = stats.json().await.unwrap();
    assert_eq!(stats, stub.stats());
    assert_eq!(
        stats,
        Stats {
            requests: 4,
            effects: 3,
            ..Stats::default()
        }
    );
    let all = client
        .get(format!("{}/v1/messages", stub.url()))
        .send()
        .await
        .unwrap();
    let all: Vec<Message> = all.json().await.unwrap();
    assert_eq!(all, stub.messages());
    let ids: Vec<&str> = all.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["msg_1", "msg_2", "msg_3"]);
}

#[tokio::test]
async fn a_fault_rate_and_latency_set_over_http_apply_to_new_keys() {
    let (stub, client) = (stub().await, client());

    let refused = control(
        &client,
        &stub,
        "fault_rate",
        &json!({ "fail_before": 0.7, "fail_after": 0.5 }),
    )
    .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    let all_fail = json!({ "fail_before": 1.0, "seed": 7 });
    let set = control(&client, &stub, "fault_rate", &all_fail).await;
    assert_eq!(set.status, StatusCode::OK);
    for key in ["k1", "k2", "k3"] {
        let failed = send(&client, &stub, key, &sms(key)).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert!(stub.messages().is_empty());

    // An injected fault goes first, whatever the rate.
    stub.set_fault_rate(FaultRate::default()).unwrap();
    stub.inject(Fault::FailAfter);
    let failed = send(&client, &stub, "k4", &sms("k4")).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(stub.effects_for("k4"), 1);

    let latency = control(&client, &stub, "latency", &json!({ "delay_ms": 150 })).await;
    assert_eq!(latency.status, StatusCode::OK);
    let started = Instant::now();
    let slow = send(&client, &stub, "k5", &sms("k5")).await;
    assert_eq!(slow.status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(150));
    // A replay does not run the request again, so it does not wait.
    let started = Instant::now();
    assert!(send(&client, &stub, "k5", &sms("k5")).await.replayed);
    assert!(started.elapsed() < Duration::from_millis(150));
}

#[tokio::test]
async fn stop_ends_the_server() {
    let (stub, client) = (stub().await, client());
    let url = stub.url();

    stub.stop().await.unwrap();

    let refused = client.get(format!("{url}/v1/messages")).send().await;
    assert!(refused.is_err());
}
