//! `/readyz` answers 503 when the store answers but cannot take writes: it probes with
//! a real write. The embedded store on a file system that fills up; Postgres through a
//! URL that reaches a standby, which is read-only, until it is promoted.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fencegate_tests::cluster::Cluster;
use fencegate_tests::eventually;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::{metric_value, Client, Reply};
use fencegate_tests::proxy::Proxy;

const WAIT: Duration = Duration::from_secs(20);

/// A small tmpfs mounted on a fresh directory, unmounted and removed when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(size: &str) -> SmallDisk {
        let dir = std::env::temp_dir().join(format!(
            "fencegate-disk-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .expect("the mount command runs");
        assert!(
            mounted.status.success(),
            "this test mounts a small tmpfs to fill a disk for real, which needs root (or \
             CAP_SYS_ADMIN): mount failed: {}",
            String::from_utf8_lossy(&mounted.stderr)
        );
        SmallDisk(dir)
    }

    /// Fills the disk with `filler` until it has no room left.
    fn fill(&self) -> PathBuf {
        use std::io::Write as _;
        let filler = self.0.join("filler");
        let mut file = std::fs::File::create(&filler).unwrap();
        let chunk = vec![1u8; 4096];
        loop {
            if let Err(error) = file.write_all(&chunk).and_then(|()| file.sync_all()) {
                assert_eq!(error.kind(), std::io::ErrorKind::StorageFull, "{error}");
                return filler;
            }
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

async fn readyz(client: &Client) -> Reply {
    client.request(http::Method::GET, "/readyz", &[], "").await
}

async fn wait_for_status(client: &Client, status: u16) -> Reply {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let reply = readyz(client).await;
        if reply.status == status {
            return reply;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz did not answer {status} within {WAIT:?}; last: {} {:?}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_full_disk_makes_the_embedded_store_unready() {
    let disk = SmallDisk::mount("8m");
    let data: &Path = &disk.0.join("data");
    let gateway = Gateway::builder()
        .arg("--data-dir")
        .arg(data.display().to_string())
        .spawn()
        .await;
    let client = gateway.client();
    assert_eq!(
        metric_value(&client.metrics().await, "fencegate_store_writable"),
        Some(1.0),
        "probed at start, before any /readyz"
    );
    assert_eq!(client.put("orders", "o-1", 1, "v").await.status, 201);
    let ready = readyz(&client).await;
    assert_eq!(ready.status, 200);
    assert_eq!(ready.json()["status"], "ready");
    assert_eq!(
        metric_value(&client.metrics().await, "fencegate_store_writable"),
        Some(1.0)
    );

    let filler = disk.fill();
    let unready = wait_for_status(&client, 503).await;
    let body = unready.json();
    assert_eq!(
        (&body["error"], &body["reason"]),
        (
            &serde_json::json!("backend_unavailable"),
            &serde_json::json!("disk_full")
        ),
        "{body}"
    );
    assert!(
        body["message"].as_str().unwrap().contains("disk is full"),
        "{body}"
    );
    let metrics = client.metrics().await;
    assert_eq!(
        metric_value(&metrics, "fencegate_store_writable"),
        Some(0.0)
    );
    let logged = gateway.events("the store cannot take writes: not ready");
    assert!(
        logged
            .iter()
            .any(|event| event["fields"]["reason"] == "disk_full"),
        "{logged:?}"
    );

    std::fs::remove_file(filler).unwrap();
    wait_for_status(&client, 200).await;
    assert_eq!(
        metric_value(&client.metrics().await, "fencegate_store_writable"),
        Some(1.0)
    );
    assert_eq!(client.put("orders", "o-1", 2, "w").await.status, 200);
    drop(gateway);
}

/// A URL that may reach either server (`target_session_attrs=any`), the primary
/// first: once the primary is gone, the gateway's connections reach the standby,
/// which answers reads but refuses every write.
#[tokio::test]
async fn a_read_only_database_makes_the_postgres_store_unready() {
    let mut primary = Cluster::builder()
        .hba("host replication postgres 127.0.0.1/32 trust")
        .hba("host all all 127.0.0.1/32 scram-sha-256")
        .start()
        .await;
    let replication = Proxy::start(primary.addr()).await;
    let standby = primary.standby(replication.addr()).await;
    let url = format!(
        "postgres://postgres:{}@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=any",
        primary.password(),
        primary.port(),
        standby.port()
    );
    let gateway = Gateway::builder()
        .database(&url)
        .args(&["--pg-listen", "off", "--backend-timeout", "2s"])
        .spawn()
        .await;
    let client = gateway.client();
    assert_eq!(readyz(&client).await.status, 200);
    // The schema, its probe row included, reaches the standby.
    assert_eq!(client.put("orders", "o-1", 1, "v").await.status, 201);
    eventually(WAIT, "the standby to replay the schema", || async {
        standby
            .client()
            .await
            .query_opt("SELECT FROM fencegate.readiness", &[])
            .await
            .is_ok_and(|row| row.is_some())
    })
    .await;

    primary.stop().await;
    let unready = wait_for_status(&client, 503).await;
    let body = unready.json();
    assert_eq!(body["reason"], "read_only", "{body}");
    assert_eq!(body["error"], "backend_unavailable", "{body}");
    assert_eq!(
        metric_value(&client.metrics().await, "fencegate_store_writable"),
        Some(0.0)
    );
    let write = client.put("orders", "o-1", 2, "w").await;
    assert_ne!(
        write.status / 100,
        2,
        "the standby took a write: {:?}",
        write.body
    );

    standby.promote().await;
    wait_for_status(&client, 200).await;
    assert_eq!(
        metric_value(&client.metrics().await, "fencegate_store_writable"),
        Some(1.0)
    );
    drop(gateway);
}
