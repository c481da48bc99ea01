//! A throwaway Postgres cluster of the test's own.
