//! S3 upstreams for the S3 door: a real radosgw the tests start ([`rgw`]) and a small
//! SigV4-signing client to drive it ([`client`]).

pub mod client;
pub mod rgw;

pub use client::S3Client;
pub use rgw::Radosgw;
pub mod door;
pub mod recorded;
