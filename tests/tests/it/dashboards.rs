//! `dashboards/`: the Grafana dashboard, the alerting rules and the scrape config,
//! proven against a real gateway scraped by a real Prometheus.
//!
//! - `promtool` accepts `alerts.yml` and `prometheus.yml`.
//! - `fencegate.json` type-checks against `@grafana/schema`'s `Dashboard`, and the same
//!   check rejects a misspelt key (so it is known to bite).
//! - The dashboard's structure: panels with a datasource and targets, unique ids, no
//!   overlapping panels, every template variable defined before it is used.
//! - Live: a gateway (its database behind a proxy, so the test can take it away) is
//!   scraped every second by Prometheus, which evaluates a copy of `alerts.yml` every
//!   second with every `for:` shortened. After stale rejections, accepted writes and a
//!   database outage, every metric name the dashboard and rules use is exported, every
//!   expression runs, the gateway panels show data for the rejected resource, and the
//!   stale-write and token-lag alerts fire.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fencegate_tests::db::{server_addr, TestDb};
use fencegate_tests::eventually;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::prometheus::grafana::{label_values, replace_variables, variables_in};
use fencegate_tests::prometheus::{
    exported_names, metric_names, promtool, sample_value, Prometheus,
};
use fencegate_tests::proxy::Proxy;
use serde_json::Value;

/// The job name the rules expect (`up{job="fencegate"}`), as in `prometheus.yml`.
const JOB: &str = "fencegate";
/// The resource the live test rejects stale writes on.
const RESOURCE: &str = "orders";
/// What Grafana's `$__rate_interval` stands for in the live test: several scrapes at
/// one per second, and longer than the whole test, so windows see every change.
const RATE_INTERVAL: &str = "2m";
/// The `for:` every alerting rule gets in the live test.
const TEST_FOR: &str = "2s";
/// Grafana's built-in variables the dashboard may use.
const GRAFANA_BUILTINS: &[&str] = &["__rate_interval", "__interval", "__range"];
/// The lease client's metrics, exported by writer processes (none runs in the live
/// test). The dashboard's lease panels may use only these names, as documented in
/// `dashboards/README.md`; `lease_metric_names_are_the_lease_clients` holds them to
/// the lease client's source.
const LEASE_METRICS: &[&str] = &[
    "fencegate_lease_transitions_total",
    "fencegate_lease_lost_total",
    "fencegate_lease_is_leader",
    "fencegate_lease_epoch",
];
/// Generous bound for anything the live test waits for.
const WAIT: Duration = Duration::from_secs(60);

fn dashboards_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("dashboards")
}

fn read(name: &str) -> String {
    let path = dashboards_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn dashboard() -> Value {
    serde_json::from_str(&read("fencegate.json")).expect("fencegate.json is JSON")
}

#[test]
fn promtool_accepts_the_rules_and_the_scrape_config() {
    for args in [
        ["check", "rules", "alerts.yml"],
        ["check", "config", "prometheus.yml"],
    ] {
        let output = std::process::Command::new(promtool())
            .args(args)
            .current_dir(dashboards_dir())
            .output()
            .expect("promtool runs");
        assert!(
            output.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn lease_metric_names_are_the_lease_clients() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../lease-client/src/metrics.rs");
    let source =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for name in LEASE_METRICS {
        assert!(
            source.contains(&format!("\"{name}\"")),
            "the lease client does not register {name}"
        );
    }
}

#[test]
fn dashboard_satisfies_grafanas_dashboard_type() {
    let project = dashboards_dir().join("typecheck");
    if !project.join("node_modules").join("typescript").exists() {
        let npm = std::process::Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&project)
            .status()
            .expect("npm runs (install Node.js and npm)");
        assert!(npm.success(), "npm ci in {} failed", project.display());
    }
    let check = |dashboard: &Path| {
        let output = std::process::Command::new("node")
            .arg("check.mjs")
            .arg(dashboard)
            .current_dir(&project)
            .output()
            .expect("node runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), text)
    };

    let (ok, output) = check(&dashboards_dir().join("fencegate.json"));
    assert!(ok, "fencegate.json does not satisfy Dashboard:\n{output}");

    // The same check must reject a key Grafana does not know.
    let mut misspelt = dashboard();
    let panel = misspelt["panels"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["type"] != "row")
        .unwrap();
    let title = panel.as_object_mut().unwrap().remove("title").unwrap();
    panel["titel"] = title;
    let copy = std::env::temp_dir().join(format!("fencegate-misspelt-{}.json", std::process::id()));
    std::fs::write(&copy, serde_json::to_string_pretty(&misspelt).unwrap()).unwrap();
    let (ok, output) = check(&copy);
    let _ = std::fs::remove_file(&copy);
    assert!(
        !ok && output.contains("titel"),
        "a misspelt panel key was not reported:\n{output}"
    );
}

#[test]
fn dashboard_is_well_formed() {
    let dashboard = dashboard();
    assert!(
        dashboard["uid"].as_str().is_some_and(|uid| !uid.is_empty()),
        "the dashboard has a stable uid"
    );
    assert!(dashboard["schemaVersion"].as_u64().is_some());

    // Variables: a prometheus datasource, then query variables on it, each using only
    // variables defined before it.
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    let mut defined: BTreeSet<String> = GRAFANA_BUILTINS
        .iter()
        .map(|name| name.to_string())
        .collect();
    for variable in variables {
        let name = variable["name"].as_str().expect("a variable has a name");
        match variable["type"].as_str() {
            Some("datasource") => assert_eq!(variable["query"], "prometheus", "{name}"),
            Some("query") => {
                assert_uses_datasource_variable(&variable["datasource"], name);
                let query = variable["query"]
                    .as_str()
                    .expect("a query variable has a query");
                let (selector, label) = selector_and_label(query);
                assert!(!selector.is_empty() && !label.is_empty(), "{name}: {query}");
                assert_defined(&defined, query, name);
            }
            other => panic!("variable {name} has an unexpected type {other:?}"),
        }
        assert!(
            defined.insert(name.to_owned()),
            "variable {name} is defined twice"
        );
    }
    for name in ["datasource", "job", "resource"] {
        assert!(
            defined.contains(name),
            "the dashboard has a {name} variable"
        );
    }
    let resource = variables.iter().find(|v| v["name"] == "resource").unwrap();
    assert!(
        resource["query"]
            .as_str()
            .unwrap()
            .starts_with("label_values("),
        "resource comes from label_values"
    );

    let panels = all_panels(&dashboard);
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(&str, [u64; 4])> = Vec::new();
    for panel in &panels {
        let title = panel["title"].as_str().expect("every panel has a title");
        let id = panel["id"].as_u64().expect("every panel has an id");
        assert!(ids.insert(id), "panel id {id} ({title}) is used twice");
        let grid = &panel["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| {
            grid[k]
                .as_u64()
                .unwrap_or_else(|| panic!("{title}: gridPos.{k}"))
        });
        assert!(x + w <= 24, "{title} is wider than the dashboard");
        for (other, [ox, oy, ow, oh]) in &boxes {
            let apart = x + w <= *ox || ox + ow <= x || y + h <= *oy || oy + oh <= y;
            assert!(apart, "{title} overlaps {other}");
        }
        boxes.push((title, [x, y, w, h]));
        if panel["type"] == "row" {
            continue;
        }
        assert_uses_datasource_variable(&panel["datasource"], title);
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty());
        let targets = targets.unwrap_or_else(|| panic!("{title} has no targets"));
        let mut ref_ids = BTreeSet::new();
        for target in targets {
            let ref_id = target["refId"]
                .as_str()
                .unwrap_or_else(|| panic!("{title}: a target without refId"));
            assert!(ref_ids.insert(ref_id), "{title}: refId {ref_id} twice");
            assert_uses_datasource_variable(&target["datasource"], title);
            let expr = target["expr"].as_str().filter(|e| !e.trim().is_empty());
            assert_defined(
                &defined,
                expr.unwrap_or_else(|| panic!("{title} {ref_id}: no expr")),
                title,
            );
        }
    }
}

fn assert_uses_datasource_variable(datasource: &Value, what: &str) {
    assert_eq!(datasource["type"], "prometheus", "{what}: datasource type");
    assert_eq!(
        datasource["uid"], "${datasource}",
        "{what}: datasource must be the $datasource variable"
    );
}

fn assert_defined(defined: &BTreeSet<String>, text: &str, what: &str) {
    for name in variables_in(text) {
        assert!(
            defined.contains(&name),
            "{what} uses ${name}, which is not defined before it: {text}"
        );
    }
}

/// `text` with its Grafana variables replaced by `values`; panics on an unknown one.
fn substitute(text: &str, values: &BTreeMap<&str, &str>) -> String {
    replace_variables(text, |name| {
        let value = values.get(name);
        value
            .unwrap_or_else(|| panic!("no test value for ${name} in {text}"))
            .to_string()
    })
}

/// `label_values(selector, label)` of a variable query; panics on any other query.
fn selector_and_label(query: &str) -> (&str, &str) {
    label_values(query).unwrap_or_else(|| panic!("not label_values(selector, label): {query}"))
}

/// Every panel, including those nested in collapsed rows.
fn all_panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        out.push(panel);
        out.extend(panel["panels"].as_array().into_iter().flatten());
    }
    out
}

/// `alerts.yml` with every `for:` set to [`TEST_FOR`], so that alerts fire within the
/// test; everything else is the file as shipped.
fn rules_for_test() -> String {
    let rules = read("alerts.yml");
    let mut replaced = 0;
    let out: Vec<String> = rules
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            if trimmed.starts_with("for:") {
                replaced += 1;
                format!("{}for: {TEST_FOR}", &line[..line.len() - trimmed.len()])
            } else {
                line.to_owned()
            }
        })
        .collect();
    assert!(replaced > 0, "alerts.yml has no for: to shorten");
    out.join("\n") + "\n"
}

fn prometheus_config(gateway: SocketAddr) -> String {
    format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n  - alerts.yml\n\
         scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: ['{gateway}']\n"
    )
}

/// Every target's `(panel title and refId, expr)`.
fn dashboard_exprs(dashboard: &Value) -> Vec<(String, String)> {
    let mut exprs = Vec::new();
    for panel in all_panels(dashboard)
        .into_iter()
        .filter(|p| p["type"] != "row")
    {
        for target in panel["targets"].as_array().unwrap() {
            let at = format!(
                "{} {}",
                panel["title"].as_str().unwrap(),
                target["refId"].as_str().unwrap()
            );
            exprs.push((at, target["expr"].as_str().unwrap().to_owned()));
        }
    }
    exprs
}

/// Every alerting rule Prometheus loaded is one of `alerts.yml`, with the shortened
/// `for:` and useful annotations.
async fn check_loaded_rules(prometheus: &Prometheus) {
    let rules = prometheus.rules().await;
    let in_file = read("alerts.yml")
        .lines()
        .filter(|line| line.trim_start().starts_with("- alert:"))
        .count();
    assert_eq!(
        rules.len(),
        in_file,
        "Prometheus loaded every rule of alerts.yml: {rules:?}"
    );
    for rule in &rules {
        assert_eq!(rule["type"], "alerting", "{rule}");
        assert_eq!(rule["duration"], 2, "for: was shortened: {rule}");
        for annotation in ["summary", "description"] {
            let text = rule["annotations"][annotation].as_str().unwrap_or_default();
            assert!(
                text.len() > 20,
                "{} has no useful {annotation}",
                rule["name"]
            );
        }
    }
}

/// Every `fencegate_*` name in the dashboard and the rules is exported by the gateway,
/// or is one of the documented lease-client metrics.
async fn check_metric_names(prometheus: &Prometheus, exposition: &str) {
    let dashboard = dashboard();
    let exported = exported_names(exposition);
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let mut exprs: Vec<String> = dashboard_exprs(&dashboard)
        .into_iter()
        .map(|(_, expr)| expr)
        .collect();
    exprs.extend(
        variables
            .iter()
            .filter_map(|v| v["query"].as_str())
            .map(str::to_owned),
    );
    exprs.extend(
        prometheus
            .rules()
            .await
            .iter()
            .map(|rule| rule["query"].as_str().unwrap().to_owned()),
    );
    for expr in exprs {
        for name in metric_names(&expr, "fencegate_") {
            let known = exported.contains(&name) || LEASE_METRICS.contains(&name.as_str());
            assert!(
                known,
                "{name} (in {expr}) is not exported by the gateway, which exports {exported:?}"
            );
        }
    }
}

/// Every dashboard query runs; every query on gateway metrics has data, for
/// [`RESOURCE`] where it is filtered by resource; the variables list what the test
/// produced; every rule's expression runs and evaluates without error.
async fn check_queries(prometheus: &Prometheus) {
    let dashboard = dashboard();
    let values = BTreeMap::from([
        ("job", JOB),
        ("resource", RESOURCE),
        ("__rate_interval", RATE_INTERVAL),
    ]);
    let mut ours = BTreeMap::new();
    for (at, expr) in dashboard_exprs(&dashboard) {
        let query = substitute(&expr, &values);
        let result = prometheus
            .query(&query)
            .await
            .unwrap_or_else(|e| panic!("{at}: {query}: {e}"));
        if metric_names(&expr, "fencegate_")
            .iter()
            .any(|name| LEASE_METRICS.contains(&name.as_str()))
        {
            continue; // no writer process exports these here
        }
        assert!(!result.is_empty(), "{at} has no data: {query}");
        if expr.contains("$resource") {
            let series = result
                .iter()
                .find(|series| series["metric"]["resource"] == RESOURCE);
            let series =
                series.unwrap_or_else(|| panic!("{at} has no series for {RESOURCE}: {result:?}"));
            ours.insert(at, sample_value(series));
        }
    }
    assert!(
        ours["Stale rejections per second by resource A"] > 0.0,
        "{ours:?}"
    );
    assert_eq!(
        ours["Presented vs highest token A"], 100.0,
        "highest accepted token"
    );
    assert_eq!(
        ours["Presented vs highest token B"], 42.0,
        "token of the latest stale write"
    );

    for variable in dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["type"] == "query")
    {
        let (selector, label) = selector_and_label(variable["query"].as_str().unwrap());
        let selector = substitute(selector, &values);
        let found = prometheus
            .label_values(label, &selector)
            .await
            .unwrap_or_else(|e| panic!("{selector}: {e}"));
        let expected = if label == "resource" { RESOURCE } else { JOB };
        assert!(
            found.iter().any(|v| v == expected),
            "${} = {found:?} lacks {expected}",
            variable["name"]
        );
    }

    for rule in prometheus.rules().await {
        let query = rule["query"].as_str().unwrap();
        prometheus
            .query(query)
            .await
            .unwrap_or_else(|e| panic!("rule {}: {e}", rule["name"]));
        assert_ne!(
            rule["health"], "err",
            "rule {} failed: {}",
            rule["name"], rule["lastError"]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_runs_against_a_live_gateway_and_every_alert_fires() {
    // The gateway reaches its database through a proxy, so that the test can slow the
    // database down and take it away.
    let db = TestDb::create().await;
    let database = Proxy::start(server_addr().await).await;
    let mut gateway = Gateway::builder()
        .database(&db.url_via(database.addr()))
        .spawn()
        .await;
    let client = gateway.client();
    let rules = rules_for_test();
    let prometheus = Prometheus::start(
        &prometheus_config(gateway.addr()),
        &[("alerts.yml", &rules)],
    )
    .await;
    check_loaded_rules(&prometheus).await;
    // Detection times are measured from a gateway that is already being scraped.
    prometheus
        .wait_for_data(&format!("up{{job=\"{JOB}\"}} == 1"))
        .await;
    let mut detections = Vec::new();
    // The test's database has no standby: nothing is synchronously replicated.
    let scraped = Instant::now();
    detections.push(
        prometheus
            .wait_for_firing("FencegateNotSynchronouslyReplicated", None, scraped)
            .await,
    );

    // A writer with token 41 is superseded by 42; its late write is rejected.
    assert_eq!(client.put(RESOURCE, "o-1", 41, "from 41").await.status, 201);
    assert_eq!(client.put(RESOURCE, "o-1", 42, "from 42").await.status, 200);
    let rejected = Instant::now();
    assert_eq!(client.put(RESOURCE, "o-1", 41, "late 41").await.status, 409);
    detections.push(
        prometheus
            .wait_for_firing("FencegateStaleWritesRejected", None, rejected)
            .await,
    );

    // Many terms later, a writer that slept through them is rejected: a large lag.
    assert_eq!(
        client.put(RESOURCE, "o-1", 100, "from 100").await.status,
        200
    );
    let rejected = Instant::now();
    assert_eq!(client.put(RESOURCE, "o-1", 42, "late 42").await.status, 409);
    detections.push(
        prometheus
            .wait_for_firing("FencegateLargeTokenLag", None, rejected)
            .await,
    );

    // Other routes, another resource.
    assert_eq!(client.put("invoices", "i-1", 1, "x").await.status, 201);
    assert_eq!(client.get("invoices", "i-1").await.status, 200);
    assert_eq!(client.advance("invoices", 2).await.status, 200);
    assert_eq!(client.delete("invoices", "i-1", 2).await.status, 200);
    assert_eq!(client.fence(RESOURCE).await.status, 200);
    // A keyed write, sent twice (stored, then replayed), and a transaction.
    for _ in 0..2 {
        let keyed = client
            .request(
                http::Method::PUT,
                "/v1/kv/invoices/keyed",
                &[("fencing-token", "2"), ("idempotency-key", "invoice-keyed")],
                "x",
            )
            .await;
        assert_eq!(keyed.status, 201, "{:?}", keyed.body);
    }
    let txn = client
        .request(
            http::Method::POST,
            "/v1/txn",
            &[],
            r#"{"operations": [{"op": "put", "resource": "invoices", "key": "in-txn", "token": 2, "value": "y"}]}"#,
        )
        .await;
    assert_eq!(txn.status, 200, "{:?}", txn.body);

    // A slow database: one write held in the network for 600 ms breaks the 250 ms SLO.
    database.hold();
    let slow = tokio::spawn({
        let client = client.clone();
        async move { client.put("invoices", "i-2", 2, "slow").await }
    });
    eventually(WAIT, "the slow write to reach the database", || async {
        database.held_bytes() > 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    database.release();
    assert_eq!(slow.await.unwrap().status, 201);
    let answered = Instant::now();
    detections.push(
        prometheus
            .wait_for_firing("FencegateWriteLatencyHigh", None, answered)
            .await,
    );

    // The database goes away: writes fail with 503 and count as backend errors, whose
    // counters exist from the start, at zero.
    database.cut();
    let down = Instant::now();
    let failing_write = || async {
        let failed = client.put(RESOURCE, "o-2", 100, "during outage").await;
        assert_eq!(
            (failed.status, failed.error_code()),
            (503, "backend_unavailable".to_owned())
        );
    };
    failing_write().await;
    prometheus
        .wait_for_data("fencegate_backend_errors_total")
        .await;
    for _ in 0..15 {
        failing_write().await;
    }
    detections.push(
        prometheus
            .wait_for_firing("FencegateBackendNotReady", None, down)
            .await,
    );
    detections.push(
        prometheus
            .wait_for_firing("FencegateBackendErrors", None, down)
            .await,
    );
    // While the gateway cannot reach it, the database loses the commit of token 100
    // (as a failover to an asynchronous standby would): when the connection comes
    // back, the gateway finds the fence behind what it saw committed, and restores it.
    db.execute(&format!(
        "UPDATE fencegate.fences SET highest = 50 WHERE resource = '{RESOURCE}'"
    ))
    .await;
    // Kept until the end: the gateway reaches its database through it.
    let _database = database.restore().await;
    let back = Instant::now();
    loop {
        // Another resource: a write to RESOURCE would raise its fence itself.
        let reply = client.put("invoices", "i-3", 2, "after outage").await;
        if reply.status == 201 {
            break;
        }
        assert!(
            back.elapsed() < WAIT,
            "the gateway did not recover from the outage: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    detections.push(
        prometheus
            .wait_for_firing("FencegateFenceRegressed", None, back)
            .await,
    );
    let restored = client.read_highest(RESOURCE).await;
    assert_eq!(
        restored,
        Some(100),
        "the fence is back at the token seen committed"
    );

    // A client of the door raises the fence's SQLSTATE itself: counted apart.
    let door = fencegate_tests::fenced::connect_with(
        &fencegate_tests::db::via(&db.url(), gateway.pg_addr()),
        "",
    )
    .await;
    let forged = Instant::now();
    door.batch_execute(
        "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'ZF001', MESSAGE = 'stale', \
         DETAIL = 'resource=orders presented=1 highest=2'; END $$",
    )
    .await
    .expect_err("the forged rejection");
    detections.push(
        prometheus
            .wait_for_firing("FencegateForgedRejections", None, forged)
            .await,
    );

    // The issuer bindings are changed by hand: the gateway puts its own back.
    db.execute(
        "INSERT INTO fencegate.issuer_bindings (position, pattern, prefix, issuer)
         VALUES (0, 'orders', false, 'gateway')",
    )
    .await;
    let changed = Instant::now();
    detections.push(
        prometheus
            .wait_for_firing("FencegateIssuerBindingsDrift", None, changed)
            .await,
    );

    // A flapping leader: seven terms in a row on one resource, each one scraped.
    let first_term = Instant::now();
    for token in 1..=7 {
        assert!(client.put("flappy", "k", token, "term").await.status < 300);
        prometheus
            .wait_for_data(&format!(
                "fencegate_highest_token{{resource=\"flappy\"}} == {token}"
            ))
            .await;
    }
    detections.push(
        prometheus
            .wait_for_firing("FencegateLeaderFlapping", Some("flappy"), first_term)
            .await,
    );

    // Prometheus has the final state and has scraped it twice more (rates need two
    // points); the gateway does not change from here on.
    prometheus
        .wait_for_data(&format!(
            "fencegate_stale_rejections_total{{resource=\"{RESOURCE}\"}} == 2"
        ))
        .await;
    prometheus
        .wait_for_data("fencegate_backend_ready == 1")
        .await;
    prometheus.wait_for_scrapes(JOB, 2).await;
    check_metric_names(&prometheus, &client.metrics().await).await;
    check_queries(&prometheus).await;

    // Last, the gateway goes away.
    gateway.kill().await;
    let killed = Instant::now();
    detections.push(
        prometheus
            .wait_for_firing("FencegateDown", None, killed)
            .await,
    );

    let fired: BTreeSet<&str> = detections.iter().map(|d| d.alert).collect();
    let all: BTreeSet<String> = rules
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- alert:"))
        .map(|n| n.trim().to_owned())
        .collect();
    assert_eq!(
        fired,
        all.iter().map(String::as_str).collect(),
        "every rule of alerts.yml fired"
    );
    for d in &detections {
        println!(
            "{:32} pending after {:>8.1?}  firing after {:>8.1?}  (for: {TEST_FOR})",
            d.alert,
            d.pending.unwrap_or_default(),
            d.firing
        );
    }
    prometheus.stop().await;
}
