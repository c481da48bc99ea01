//! The scenario library (tests/scenarios/*.toml), each through a real gateway and a
//! real Postgres, then its control run without fencing; plus the runner's own
//! failure report.

use std::path::{Path, PathBuf};

use fencegate_tests::replay::scenario::{Action, Outcome};
use fencegate_tests::replay::{self, RunError, Scenario, Target};

fn scenario_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(format!("{name}.toml"))
}

fn writer_binary() -> Option<PathBuf> {
    Some(PathBuf::from(env!("CARGO_BIN_EXE_fencegate-replay")))
}

/// Runs one scenario file through the gateway and then without fencing; both must pass.
async fn scenario(name: &str) {
    let scenario = Scenario::load(&scenario_path(name)).unwrap_or_else(|e| panic!("{e}"));
    let target = Target::local_with(
        scenario.gateway.replicas,
        writer_binary(),
        scenario.lease.source,
    )
    .await;
    let lines = replay::run(&scenario, &target)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        lines.len(),
        scenario.steps.len() + usize::from(name == "12-stale-flood"),
        "every step ran"
    );
    assert!(
        !scenario.control.wrong.is_empty(),
        "the scenario declares the harm without fencing"
    );
    replay::run_control(&scenario, &target)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

macro_rules! scenarios {
    ($($test:ident => $file:literal,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                scenario($file).await
            }
        )*
        /// Every file in tests/scenarios has a test above.
        #[test]
        fn every_scenario_file_has_a_test() {
            let listed = [$($file),*];
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
            let all = Scenario::load_all(&dir).unwrap_or_else(|e| panic!("{e}"));
            let mut names: Vec<String> = all.into_iter().map(|s| s.name).collect();
            names.sort();
            assert_eq!(names, listed.to_vec());
        }
    };
}

scenarios! {
    s01_delayed_request => "01-delayed-request",
    s02_tokens_41_42 => "02-tokens-41-42",
    s03_seed_psql_steps => "03-seed-psql-steps",
    s04_process_pause => "04-process-pause",
    s05_fence_advance => "05-fence-advance",
    s06_duplicate_delivery => "06-duplicate-delivery",
    s07_same_epoch_ordering => "07-same-epoch-ordering",
    s08_scope_isolation => "08-scope-isolation",
    s09_gateway_restart => "09-gateway-restart",
    s10_two_replicas => "10-two-replicas",
    s11_database_outage => "11-database-outage",
    s12_stale_flood => "12-stale-flood",
    s13_commit_reply_delayed => "13-commit-reply-delayed",
    s14_keyed_retry => "14-keyed-retry",
    s15_txn_one_step => "15-txn-one-step",
    s16_etcd_pause => "16-etcd-pause",
    s17_zookeeper_pause => "17-zookeeper-pause",
}

/// A wrong expectation fails the run at that step, naming the expected and the
/// observed outcome; the steps after it do not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_names_the_step_and_both_outcomes() {
    let mut scenario = Scenario::load(&scenario_path("01-delayed-request")).unwrap();
    let release = scenario
        .steps
        .iter()
        .position(|s| s.action == Action::Release)
        .unwrap();
    scenario.steps[release].expect.as_mut().unwrap().outcome = Some(Outcome::Accepted);
    let target = Target::local(1, None).await;
    match replay::run(&scenario, &target).await {
        Err(RunError::Mismatch {
            step,
            expected,
            observed,
            line,
            ..
        }) => {
            assert_eq!(step, release + 1);
            assert!(expected.contains("outcome=accepted"), "{expected}");
            assert!(observed.contains("outcome=rejected"), "{observed}");
            assert!(line.contains("release A1"), "{line}");
        }
        other => panic!("expected a mismatch at step {}, got {other:?}", release + 1),
    }
}

/// A control run that declares a write as harmful which in fact does not land fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_run_fails_when_the_declared_harm_does_not_happen() {
    let mut scenario = Scenario::load(&scenario_path("06-duplicate-delivery")).unwrap();
    scenario.control.wrong = vec!["never-written".into()];
    let target = Target::local(1, None).await;
    let error = replay::run_control(&scenario, &target).await.unwrap_err();
    assert!(matches!(error, RunError::Mismatch { .. }), "{error}");
}
