//! A throwaway certificate authority and server certificate.
