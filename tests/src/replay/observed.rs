//! What a step observed, and how it is compared with what the step expected.

use std::fmt::Write as _;

use crate::replay::scenario::{Expect, Outcome};
use crate::replay::wire::Reply;

/// What a step saw: the facts its `expect` may name, and a line for the report.
#[derive(Debug, Default)]
pub(crate) struct Observed {
    pub text: String,
    pub facts: Expect,
}

impl Observed {
    pub(crate) fn text(text: impl Into<String>) -> Observed {
        Observed {
            text: text.into(),
            facts: Expect {
                ..Expect::default()
            },
        }
    }

    /// A gateway answer, or a transport failure (the request got no answer).
    pub(crate) fn reply(reply: &Result<Reply, String>) -> Observed {
        let Ok(reply) = reply else {
            return Observed {
                text: "dropped (no answer)".into(),
                facts: Expect {
                    outcome: Some(Outcome::Dropped),
                    ..Expect::default()
                },
            };
        };
        let outcome = outcome_of(reply.status);
        let json = reply.json();
        let applied = match json.get("write_applied") {
            Some(serde_json::Value::Bool(false)) => Some("no".to_owned()),
            Some(serde_json::Value::Bool(true)) => Some("yes".to_owned()),
            Some(serde_json::Value::Null) => Some("unknown".to_owned()),
            _ => None,
        };
        let mut observed = Observed {
            text: String::new(),
            facts: Expect {
                outcome,
                status: Some(reply.status),
                presented: reply.field("presented"),
                highest: reply.field("highest"),
                version: reply.field("version"),
                token: reply.field("token"),
                applied,
                replayed: Some(reply.replayed),
                ..Expect::default()
            },
        };
        let name = outcome.map_or("unexpected", Outcome::name);
        observed.text = match outcome {
            Some(Outcome::Accepted) => format!(
                "{name} {} token={} version={}",
                reply.status, json["token"], json["version"]
            ),
            Some(Outcome::Rejected) => format!(
                "{name} 409 presented={} highest={}",
                json["presented"], json["highest"]
            ),
            Some(Outcome::PreconditionFailed) => {
                format!("{name} 412 current={}", json["current"])
            }
            _ => format!("{name} {} {}", reply.status, reply.body.trim()),
        };
        if reply.replayed {
            observed.text.push_str(" (replayed)");
        }
        observed
    }
}

pub(crate) fn outcome_of(status: u16) -> Option<Outcome> {
    match status {
        200 | 201 => Some(Outcome::Accepted),
        409 => Some(Outcome::Rejected),
        412 => Some(Outcome::PreconditionFailed),
        503 => Some(Outcome::Unavailable),
        _ => None,
    }
}

/// Compares what a step saw with what it expected: `Err((expected, observed))`.
pub(crate) fn check(expect: &Expect, seen: &Observed) -> Result<(), (String, String)> {
    let mut expected = String::new();
    let mut observed = String::new();
    let mut compare = |name: &str, want: Option<String>, got: Option<String>| {
        if let Some(want) = want {
            if Some(&want) != got.as_ref() {
                let _ = write!(expected, "{name}={want} ");
                let _ = write!(observed, "{name}={} ", got.unwrap_or_else(|| "-".into()));
            }
        }
    };
    let name = |o: Option<Outcome>| o.map(|o| o.name().to_owned());
    let num = |n: Option<u64>| n.map(|n| n.to_string());
    compare("outcome", name(expect.outcome), name(seen.facts.outcome));
    compare(
        "status",
        num(expect.status.map(u64::from)),
        num(seen.facts.status.map(u64::from)),
    );
    compare(
        "presented",
        num(expect.presented),
        num(seen.facts.presented),
    );
    compare("highest", num(expect.highest), num(seen.facts.highest));
    compare("version", num(expect.version), num(seen.facts.version));
    compare("token", num(expect.token), num(seen.facts.token));
    compare("value", expect.value.clone(), seen.facts.value.clone());
    compare(
        "delta",
        expect.delta.map(|d| d.to_string()),
        seen.facts.delta.map(|d| d.to_string()),
    );
    compare(
        "accepted",
        expect.accepted.map(|n| n.to_string()),
        seen.facts.accepted.map(|n| n.to_string()),
    );
    compare(
        "duplicate",
        name(expect.duplicate),
        name(seen.facts.duplicate),
    );
    compare(
        "applied",
        expect.applied.clone(),
        seen.facts.applied.clone(),
    );
    compare(
        "replayed",
        expect.replayed.map(|r| r.to_string()),
        seen.facts.replayed.map(|r| r.to_string()),
    );
    if expected.is_empty() {
        Ok(())
    } else {
        Err((
            expected.trim_end().to_owned(),
            format!("{} ({})", observed.trim_end(), seen.text),
        ))
    }
}

pub(crate) fn renewal(renewed: bool, token: u64) -> Observed {
    Observed {
        text: if renewed {
            format!("granted: renewed at token {token}")
        } else {
            format!("refused: token {token} was replaced")
        },
        facts: Expect {
            outcome: Some(if renewed {
                Outcome::Granted
            } else {
                Outcome::Refused
            }),
            token: Some(token),
            ..Expect::default()
        },
    }
}

pub(crate) fn read(reply: &Reply) -> Observed {
    if reply.status == 404 {
        return Observed {
            text: "absent".into(),
            facts: Expect {
                outcome: Some(Outcome::Absent),
                ..Expect::default()
            },
        };
    }
    let number = |h: &Option<String>| h.as_deref().and_then(|v| v.trim_matches('"').parse().ok());
    let (version, token) = (number(&reply.etag), number(&reply.token));
    Observed {
        text: format!(
            "{:?} token={} version={}",
            reply.body,
            token.map_or("-".into(), |t: u64| t.to_string()),
            version.map_or("-".into(), |v: u64| v.to_string())
        ),
        facts: Expect {
            outcome: outcome_of(reply.status),
            status: Some(reply.status),
            value: Some(reply.body.clone()),
            version,
            token,
            ..Expect::default()
        },
    }
}
