//! Where events go. Redis Streams is the only sink today; this module is the boundary the worker
//! talks to, so the worker never sees a Redis type.

pub mod redis;
