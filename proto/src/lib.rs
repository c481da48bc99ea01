//! The fencegate wire contract, shared by the gateway, the lease client and the tests.
//!
//! Nothing here performs I/O: these are the types a request is parsed into and a
//! response is built from, so that every party agrees on them byte for byte.
//!
//! # Layout
//!
//! - [`token`]: the fencing token, a decimal integer in `1..=i64::MAX`.
//! - [`names`]: resource names (the fence scope) and object keys.
//! - [`headers`]: header names and the parsing of the fencing and precondition headers.
//! - [`path`]: the API's paths, parsed into a [`path::Target`].
//! - [`error`]: the stable error codes with their HTTP status, and the parse errors.
//! - [`body`]: JSON request and response bodies.
//!
//! # Invariants
//!
//! - A [`Token`] is never zero and always fits a Postgres `bigint`.
//! - A [`ResourceName`] is 1–200 bytes of `[A-Za-z0-9._-]`; an [`ObjectKey`] is 1–1024 bytes
//!   of UTF-8 without control characters. Values of these types were validated on
//!   construction, so code that holds one needs no further check.
#![forbid(unsafe_code)]

pub mod body;
pub mod error;
pub mod headers;
pub mod names;
pub mod path;
pub mod token;

pub use error::{ErrorCode, ProtoError};
pub use names::{ObjectKey, ResourceName};
pub use token::Token;
