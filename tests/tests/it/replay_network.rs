//! The per-request network controls the scenario library does not already use: drop,
//! delay and reorder, each as a scenario step through a real gateway.

use fencegate_tests::replay::{self, Scenario, Target};

async fn run(text: &str) -> Vec<String> {
    let scenario = Scenario::from_toml(text, "inline").unwrap_or_else(|e| panic!("{e}"));
    let target = Target::local(1, None).await;
    let lines = replay::run(&scenario, &target)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(lines.len(), scenario.steps.len(), "every step ran");
    replay::run_control(&scenario, &target)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    lines
}

/// A dropped request never reaches the gateway: no answer, nothing stored, and the
/// next write of the key is its first version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_write_changes_nothing() {
    run(r#"
        name = "drop"
        control = { wrong = ["kept"] }

        [[step]]
        actor = "A"
        action = "write"
        label = "lost"
        token = 5
        value = "never"
        hold = true

        [[step]]
        action = "drop"
        label = "lost"
        expect = { outcome = "dropped" }

        [[step]]
        action = "read"
        expect = { outcome = "absent" }

        [[step]]
        actor = "A"
        action = "write"
        label = "kept"
        token = 5
        value = "kept"
        expect = { outcome = "accepted", version = 1 }
    "#)
    .await;
}

/// A write delayed in the network arrives after the newer term's write: rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_write_arrives_late_and_is_rejected() {
    run(r#"
        name = "delay"
        control = { wrong = ["A1"], stored = [{ key = "k", value = "a (delayed)" }] }

        [[step]]
        actor = "A"
        action = "acquire"

        [[step]]
        actor = "A"
        action = "write"
        label = "A1"
        value = "a (delayed)"
        delay = "3s"

        [[step]]
        action = "expire"

        [[step]]
        actor = "B"
        action = "acquire"

        [[step]]
        actor = "B"
        action = "write"
        label = "B1"
        value = "b"
        expect = { outcome = "accepted", version = 1 }

        [[step]]
        action = "await"
        label = "A1"
        expect = { outcome = "rejected", presented = 1, highest = 2 }
    "#)
    .await;
}

/// Two held writes delivered in the reverse of their sending order: the one sent
/// second is handled first, so the one sent first fails its precondition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reordered_writes_are_handled_in_the_new_order() {
    let lines = run(r#"
        name = "reorder"
        control = { wrong = ["first"], stored = [{ key = "k", value = "sent first" }] }

        [[step]]
        actor = "A"
        action = "acquire"

        [[step]]
        actor = "A"
        action = "write"
        label = "first"
        value = "sent first"
        if_match = "0"
        hold = true

        [[step]]
        actor = "A"
        action = "write"
        label = "second"
        value = "sent second"
        if_match = "0"
        hold = true

        [[step]]
        action = "reorder"
        labels = ["second", "first"]

        [[step]]
        action = "await"
        label = "second"
        expect = { outcome = "accepted", version = 1 }

        [[step]]
        action = "await"
        label = "first"
        expect = { outcome = "precondition_failed" }

        [[step]]
        action = "read"
        expect = { value = "sent second" }
    "#)
    .await;
    assert!(
        lines
            .iter()
            .any(|l| l.contains("answered in the order second, first")),
        "{lines:?}"
    );
}
