//! Fenced SQL transactions: parameter and column conversion for every supported type,
//! and every error the endpoint answers with.

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::Reply;
use http::Method;
use serde_json::{json, Value};

/// One statement, with its parameters.
fn one(statement: &str, params: Value) -> Value {
    json!({"statements": [{"sql": statement, "params": params}]})
}

/// Every supported type, as a column and as an array column: each value goes in as a
/// parameter and comes back, through `RETURNING` and through a later `SELECT`, as the
/// same JSON.
#[tokio::test]
async fn every_supported_type_round_trips() {
    let db = TestDb::create().await;
    let columns = [
        ("b", "bool", json!(true)),
        ("i2", "int2", json!(-32768)),
        ("i4", "int4", json!(2147483647)),
        ("i8", "int8", json!(9007199254740993i64)),
        ("f4", "float4", json!(1.5)),
        ("f8", "float8", json!(-0.125)),
        ("num", "numeric", json!("12345678901234567890.1250")),
        ("t", "text", json!("naïve ✓ 'quoted' \"double\"")),
        ("vc", "varchar(20)", json!("short")),
        ("js", "json", json!({"a": [1, 2, {"b": null}]})),
        ("jb", "jsonb", json!({"k": "v", "n": 1.5})),
        ("u", "uuid", json!("67e55044-10b1-426f-9247-bb680e5fe0c8")),
        ("tz", "timestamptz", json!("2026-01-31T12:00:00.123456Z")),
        ("ts", "timestamp", json!("2026-01-31T12:00:00.250")),
        ("d", "date", json!("2026-01-31")),
        ("by", "bytea", json!("AAEC/w==")),
        ("ai8", "int8[]", json!([1, null, 3])),
        ("at", "text[]", json!(["a", null, "c"])),
        ("ab", "bool[]", json!([true, false])),
        ("af8", "float8[]", json!([0.5, "NaN", "-Infinity"])),
        ("anum", "numeric[]", json!(["1.5", "-2"])),
        (
            "au",
            "uuid[]",
            json!(["67e55044-10b1-426f-9247-bb680e5fe0c8"]),
        ),
        ("atz", "timestamptz[]", json!(["2026-01-31T12:00:00Z"])),
        ("ad", "date[]", json!(["2026-01-31", null])),
        ("aby", "bytea[]", json!(["AQI="])),
        ("ajb", "jsonb[]", json!([{"x": 1}, [1, 2]])),
    ];
    let definition: Vec<String> = columns
        .iter()
        .map(|(name, ty, _)| format!("{name} {ty}"))
        .collect();
    db.execute(&format!(
        "CREATE TABLE typed (id int PRIMARY KEY, {})",
        definition.join(", ")
    ))
    .await;
    let gateway = Gateway::with_sql(&db).await;
    let client = gateway.client();

    let names: Vec<&str> = columns.iter().map(|(name, _, _)| *name).collect();
    let placeholders: Vec<String> = (2..=columns.len() + 1).map(|i| format!("${i}")).collect();
    let mut params = vec![json!(1)];
    params.extend(columns.iter().map(|(_, _, value)| value.clone()));
    let insert = format!(
        "INSERT INTO typed (id, {}) VALUES ($1, {}) RETURNING {}",
        names.join(", "),
        placeholders.join(", "),
        names.join(", ")
    );
    let reply = client
        .sql("typed", 1, one(&insert, Value::Array(params)))
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let result = &reply.json()["results"][0];
    assert_eq!(result["rows_affected"], 1);
    let expected: Vec<Value> = columns.iter().map(|(_, _, value)| value.clone()).collect();
    let types: Vec<Value> = result["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].clone())
        .collect();
    assert_eq!(types[0], "bool");
    assert_eq!(types[8], "varchar");
    assert_eq!(types[16], "int8[]");
    for (i, (name, ty, value)) in columns.iter().enumerate() {
        assert_eq!(
            &result["rows"][0][i], value,
            "{name} {ty} through RETURNING"
        );
    }

    let select = format!("SELECT {} FROM typed WHERE id = $1", names.join(", "));
    let reply = client.sql("typed", 1, one(&select, json!([1]))).await;
    assert_eq!(
        reply.json()["results"][0]["rows"][0],
        Value::Array(expected),
        "through SELECT"
    );

    // NULL everywhere: JSON null in, JSON null out.
    let nulls: Vec<Value> = std::iter::once(json!(2))
        .chain(columns.iter().map(|_| Value::Null))
        .collect();
    let reply = client
        .sql("typed", 1, one(&insert, Value::Array(nulls)))
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let row = reply.json()["results"][0]["rows"][0].clone();
    assert!(row.as_array().unwrap().iter().all(Value::is_null), "{row}");

    // Postgres stored what was sent, not a lookalike.
    let stored = db.client().await.query_one("SELECT i8, num::text, by, tz = '2026-01-31 12:00:00.123456+00' FROM typed WHERE id = 1", &[]).await.unwrap();
    assert_eq!(stored.get::<_, i64>(0), 9007199254740993);
    assert_eq!(stored.get::<_, String>(1), "12345678901234567890.1250");
    assert_eq!(stored.get::<_, Vec<u8>>(2), vec![0, 1, 2, 255]);
    assert!(stored.get::<_, bool>(3));

    // Other offsets are converted to UTC; numbers are accepted for numeric.
    let reply = client
        .sql(
            "typed",
            1,
            one(
                "SELECT $1::timestamptz, $2::numeric",
                json!(["2026-01-31T14:00:00+02:00", 2.5]),
            ),
        )
        .await;
    assert_eq!(
        reply.json()["results"][0]["rows"][0],
        json!(["2026-01-31T12:00:00Z", "2.5"])
    );
}

/// Each error code of the endpoint, with the facts its body carries.
#[tokio::test]
async fn each_error_is_answered_with_its_code() {
    let db = TestDb::create().await;
    db.execute("CREATE TABLE t (id int PRIMARY KEY, at timestamptz)")
        .await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .sql_as(&db.writer().await)
        .arg("--sql-max-statements")
        .arg("3")
        .arg("--sql-max-rows")
        .arg("4")
        .arg("--sql-statement-timeout")
        .arg("200ms")
        .arg("--max-body")
        .arg("4KiB")
        .spawn()
        .await;
    let client = gateway.client();
    let check = |reply: &Reply, status: u16, code: &str| {
        assert_eq!(
            (reply.status, reply.error_code().as_str()),
            (status, code),
            "{:?}",
            reply.body
        );
        reply.json()
    };

    let body = check(
        &client.sql("r", 1, one("SELEC 1", json!([]))).await,
        400,
        "statement_not_allowed",
    );
    assert_eq!(body["statement"], 0);
    let body = check(
        &client
            .sql("r", 1, one("SELECT * FROM missing_table", json!([])))
            .await,
        400,
        "sql_error",
    );
    assert_eq!(
        (body["statement"].as_u64(), body["sqlstate"].as_str()),
        (Some(0), Some("42P01"))
    );
    let body = check(
        &client
            .sql("r", 1, one("SELECT pg_sleep(5)", json!([])))
            .await,
        400,
        "sql_error",
    );
    assert_eq!(body["sqlstate"], "57014", "the statement timeout");

    let body = check(
        &client
            .sql(
                "r",
                1,
                one("INSERT INTO t (id) VALUES ($1)", json!(["seven"])),
            )
            .await,
        400,
        "invalid_param",
    );
    assert_eq!(
        (body["statement"].as_u64(), body["parameter"].as_u64()),
        (Some(0), Some(1))
    );
    assert!(body["message"].as_str().unwrap().contains("int4"), "{body}");
    let body = check(
        &client
            .sql(
                "r",
                1,
                one(
                    "UPDATE t SET at = $2 WHERE id = $1",
                    json!([1, "yesterday"]),
                ),
            )
            .await,
        400,
        "invalid_param",
    );
    assert_eq!(body["parameter"], 2);
    let body = check(
        &client
            .sql("r", 1, one("SELECT $1::int, $2::int", json!([1])))
            .await,
        400,
        "invalid_param",
    );
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("takes 2 parameters, 1 given"),
        "{body}"
    );
    check(
        &client
            .sql("r", 1, one("SELECT 70000::int2 + $1", json!([70000])))
            .await,
        400,
        "invalid_param",
    );

    let body = check(
        &client
            .sql("r", 1, one("SELECT now() - now() AS age", json!([])))
            .await,
        400,
        "unsupported_type",
    );
    assert!(
        body["message"].as_str().unwrap().contains("interval"),
        "{body}"
    );
    let body = check(
        &client
            .sql("r", 1, one("SELECT $1::inet", json!(["10.0.0.1"])))
            .await,
        400,
        "unsupported_type",
    );
    assert_eq!(body["parameter"], 1);

    let four = json!({"statements": [{"sql": "SELECT 1"}, {"sql": "SELECT 1"}, {"sql": "SELECT 1"}, {"sql": "SELECT 1"}]});
    check(&client.sql("r", 1, four).await, 400, "too_many_statements");
    let long = format!("SELECT '{}'", "x".repeat(5000));
    check(
        &client.sql("r", 1, one(&long, json!([]))).await,
        413,
        "body_too_large",
    );
    check(
        &client.sql("r", 1, json!({"statements": []})).await,
        400,
        "invalid_body",
    );
    check(
        &client.sql("r", 1, json!({"statement": "SELECT 1"})).await,
        400,
        "invalid_body",
    );
    let not_json = client
        .request(
            Method::POST,
            "/v1/sql/r",
            &[("fencing-token", "1")],
            "SELECT 1",
        )
        .await;
    check(&not_json, 400, "invalid_body");
    let no_token = client
        .request(
            Method::POST,
            "/v1/sql/r",
            &[],
            one("SELECT 1", json!([])).to_string(),
        )
        .await;
    check(&no_token, 428, "missing_token");
    let get = client.request(Method::GET, "/v1/sql/r", &[], "").await;
    check(&get, 405, "method_not_allowed");
    assert_eq!(get.header("allow"), Some("POST"));

    // None of the refusals above raised the fence.
    assert_eq!(db.highest("r").await, None);

    assert_eq!(
        client.sql("r", 5, one("SELECT 1", json!([]))).await.status,
        200
    );
    let stale = client.sql("r", 4, one("SELECT 1", json!([]))).await;
    let body = check(&stale, 409, "stale_token");
    assert_eq!(body["highest"], 5);

    // Rows past --sql-max-rows (over the whole answer) are counted, not returned.
    let rows = json!({"statements": [
        {"sql": "SELECT generate_series(1, 3) AS n"},
        {"sql": "SELECT generate_series(1, 10) AS n"},
    ]});
    let reply = client.sql("r", 5, rows).await;
    assert_eq!(reply.status, 200);
    let results = &reply.json()["results"];
    assert_eq!(results[0]["rows"], json!([[1], [2], [3]]));
    assert!(results[0].get("truncated").is_none());
    assert_eq!(results[1]["rows"], json!([[1]]));
    assert_eq!(results[1]["truncated"], true);
    assert_eq!(results[1]["rows_affected"], 10);
}

#[tokio::test]
async fn without_the_flag_sql_is_disabled() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;
    let reply = gateway
        .client()
        .sql("r", 1, one("SELECT 1", json!([])))
        .await;
    assert_eq!(
        (reply.status, reply.error_code().as_str()),
        (403, "sql_disabled")
    );
    assert_eq!(db.highest("r").await, None);
}
