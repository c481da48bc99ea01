//! A real Prometheus server for tests, and the parts of its HTTP API they use.
//!
//! [`Prometheus::start`] writes a configuration (and the rule files it names) into a
//! fresh directory, starts the `prometheus` binary there on a free loopback port with
//! its TSDB in the same directory, and waits for `/-/ready`. The binary is Debian's
//! `prometheus` package (`FENCEGATE_PROMETHEUS` overrides the path); a missing binary
//! fails the test with instructions, it is never skipped.
//!
//! Queries go through `/api/v1/query`, as Grafana sends them; alerts and rules are read
//! back from `/api/v1/alerts` and `/api/v1/rules`, so the rules a test inspects are the
//! ones Prometheus actually loaded and evaluates.
//!
//! The process is killed by [`Prometheus::stop`], or when the value is dropped.
//!
//! [`metric_names`], [`exported_names`] and [`grafana`] read names out of query text
//! and of the gateway's `/metrics`, for checking one against the other.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::http::Client;

/// How long Prometheus may take to report ready.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Liveness bound for the `wait_for_*` methods: generous, a hang rather than a delay.
const WAIT: Duration = Duration::from_secs(60);

/// The Prometheus server binary.
pub fn binary() -> PathBuf {
    tool("FENCEGATE_PROMETHEUS", "prometheus")
}

/// The `promtool` binary that comes with it.
pub fn promtool() -> PathBuf {
    tool("FENCEGATE_PROMTOOL", "promtool")
}

fn tool(variable: &str, name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return path.into();
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!("`{name}` is not installed: `apt-get install prometheus` (or set {variable})")
        })
}

/// A running Prometheus server with its own configuration and storage.
pub struct Prometheus {
    child: Child,
    dir: PathBuf,
    client: Client,
}

impl Prometheus {
    /// Writes `config` as `prometheus.yml` and each `(name, contents)` of `files` next to
    /// it (rule files in the configuration are relative to it), starts the server and
    /// waits until it is ready. Panics with the server's log if it does not start.
    pub async fn start(config: &str, files: &[(&str, &str)]) -> Prometheus {
        let dir = fresh_dir();
        std::fs::write(dir.join("prometheus.yml"), config).expect("the config can be written");
        for (name, contents) in files {
            std::fs::write(dir.join(name), contents).expect("a rule file can be written");
        }
        let log =
            std::fs::File::create(dir.join("prometheus.log")).expect("the log file can be created");
        let port = crate::free_port();
        let child = Command::new(binary())
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("the prometheus binary can be executed");
        let mut prometheus = Prometheus {
            child,
            client: Client::new(format!("http://127.0.0.1:{port}")),
            dir,
        };
        prometheus.wait_ready().await;
        prometheus
    }

    async fn wait_ready(&mut self) {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            let ready = self
                .client
                .try_request(Method::GET, "/-/ready", &[], Bytes::new())
                .await;
            if matches!(ready, Ok(ref reply) if reply.status == 200) {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "prometheus exited with {status} before it was ready; log:\n{}",
                    self.log()
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "prometheus was not ready within {START_TIMEOUT:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// Evaluates `expr` as an instant query at the current time: the result's series,
    /// or the error Prometheus gave (a parse error, for example).
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self
            .api(&format!("/api/v1/query?query={}", encode(expr)))
            .await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The values of `label` on series matching `selector`, as Grafana's
    /// `label_values(selector, label)` asks for them.
    pub async fn label_values(&self, label: &str, selector: &str) -> Result<Vec<String>, String> {
        let data = self
            .api(&format!(
                "/api/v1/label/{label}/values?match[]={}",
                encode(selector)
            ))
            .await?;
        Ok(data
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|value| value.as_str().map(str::to_owned))
            .collect())
    }

    /// Every active (pending or firing) alert.
    pub async fn alerts(&self) -> Vec<Value> {
        let data = self
            .api("/api/v1/alerts")
            .await
            .unwrap_or_else(|e| panic!("/api/v1/alerts failed: {e}"));
        data["alerts"].as_array().cloned().unwrap_or_default()
    }

    /// Every loaded rule, of every group.
    pub async fn rules(&self) -> Vec<Value> {
        let data = self
            .api("/api/v1/rules")
            .await
            .unwrap_or_else(|e| panic!("/api/v1/rules failed: {e}"));
        data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
            .collect()
    }

    /// Polls `query` until its result is not empty.
    pub async fn wait_for_data(&self, query: &str) {
        let start = Instant::now();
        loop {
            let result = self
                .query(query)
                .await
                .unwrap_or_else(|e| panic!("{query}: {e}"));
            if !result.is_empty() {
                return;
            }
            assert!(start.elapsed() < WAIT, "{query} stayed empty for {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `job`'s targets have been scraped `n` more times.
    pub async fn wait_for_scrapes(&self, job: &str, n: u32) {
        let scrapes = format!("sum(count_over_time(up{{job=\"{job}\"}}[1h]))");
        let result = self
            .query(&scrapes)
            .await
            .unwrap_or_else(|e| panic!("{scrapes}: {e}"));
        let so_far = result.first().map_or(0.0, sample_value);
        self.wait_for_data(&format!("{scrapes} >= {}", so_far + f64::from(n)))
            .await;
    }

    /// Polls until alert `name` (with label `resource`, if given) is firing, checking
    /// that its annotations rendered. Times are as first seen by this poll (every
    /// 100 ms), measured from `since`.
    pub async fn wait_for_firing(
        &self,
        name: &'static str,
        resource: Option<&str>,
        since: Instant,
    ) -> Detection {
        let mut pending = None;
        loop {
            let alerts = self.alerts().await;
            let ours = alerts.iter().filter(|alert| {
                alert["labels"]["alertname"] == name
                    && resource.is_none_or(|resource| alert["labels"]["resource"] == resource)
            });
            for alert in ours {
                for annotation in ["summary", "description"] {
                    let text = alert["annotations"][annotation]
                        .as_str()
                        .unwrap_or_default();
                    let rendered = !text.is_empty()
                        && !text.contains("<no value>")
                        && !text.contains("error expanding");
                    assert!(rendered, "{name}: {annotation} did not render: {alert}");
                }
                match alert["state"].as_str() {
                    Some("pending") => {
                        pending.get_or_insert(since.elapsed());
                    }
                    Some("firing") => {
                        return Detection {
                            alert: name,
                            pending,
                            firing: since.elapsed(),
                        }
                    }
                    _ => {}
                }
            }
            assert!(
                since.elapsed() < WAIT,
                "{name} did not fire within {WAIT:?}; alerts: {alerts:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The `data` of a successful API answer, or the error of a failed one.
    async fn api(&self, path: &str) -> Result<Value, String> {
        let reply = self
            .client
            .request(Method::GET, path, &[], Bytes::new())
            .await;
        let body = reply.json();
        if body["status"] == "success" {
            Ok(body["data"].clone())
        } else {
            Err(format!(
                "HTTP {}: {} {}",
                reply.status, body["errorType"], body["error"]
            ))
        }
    }

    /// Kills the server, waits for it to exit and removes its directory.
    pub async fn stop(mut self) {
        self.child.kill().await.expect("prometheus can be killed");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// When an alert was first seen pending and firing, after the event that caused it.
#[derive(Debug, Clone)]
pub struct Detection {
    pub alert: &'static str,
    pub pending: Option<Duration>,
    pub firing: Duration,
}

/// The value of one series of an instant query result.
pub fn sample_value(series: &Value) -> f64 {
    let value = series["value"][1].as_str().and_then(|v| v.parse().ok());
    value.unwrap_or_else(|| panic!("no value in {series}"))
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        // After `stop` this finds nothing left to do; after a panic it is the cleanup.
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Percent-encodes a query-string value: everything but unreserved characters.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

/// A new empty directory under the system's temp dir.
fn fresh_dir() -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "fencegate-prometheus-{}-{}-{:08x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// Metric names with `prefix` (e.g. `fencegate_`) in a PromQL expression.
pub fn metric_names(expr: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find(prefix) {
        let inside_a_word = rest[..at].chars().next_back().is_some_and(is_word);
        let tail = &rest[at..];
        let len = tail.find(|c| !is_word(c)).unwrap_or(tail.len());
        if !inside_a_word {
            names.insert(tail[..len].to_owned());
        }
        rest = &tail[len..];
    }
    names
}

/// Sample names in a text exposition, as exported (histograms as `_bucket`, `_sum`
/// and `_count`).
pub fn exported_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| line[..line.find(['{', ' ']).unwrap_or(line.len())].to_owned())
        .collect()
}

/// Grafana's template variables in dashboard queries.
pub mod grafana {
    use super::is_word;

    /// `text` with each variable reference (`$name` or `${name}`) replaced by
    /// `value(name)`. A `$` not followed by a name (a regex anchor) is kept.
    pub fn replace_variables(text: &str, mut value: impl FnMut(&str) -> String) -> String {
        let mut out = String::new();
        let mut rest = text;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            rest = &rest[at + 1..];
            let braced = rest.starts_with('{');
            let body = if braced { &rest[1..] } else { rest };
            let len = body.find(|c| !is_word(c)).unwrap_or(body.len());
            let closed = !braced || body[len..].starts_with('}');
            if len == 0 || !closed {
                out.push('$');
                continue;
            }
            out.push_str(&value(&body[..len]));
            rest = &body[len + usize::from(braced)..];
        }
        out.push_str(rest);
        out
    }

    /// Names of the variables referenced in `text`.
    pub fn variables_in(text: &str) -> Vec<String> {
        let mut names = Vec::new();
        replace_variables(text, |name| {
            names.push(name.to_owned());
            String::new()
        });
        names
    }

    /// `label_values(selector, label)`, the variable query of Grafana's Prometheus data
    /// source, split into its selector and label; `None` for any other query.
    pub fn label_values(query: &str) -> Option<(&str, &str)> {
        let inner = query
            .trim()
            .strip_prefix("label_values(")?
            .strip_suffix(')')?;
        let (selector, label) = inner.rsplit_once(',')?;
        Some((selector.trim(), label.trim()))
    }
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}
