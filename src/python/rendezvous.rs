//! The rendezvous store for Python: the server a launcher hosts and the client its
//! ranks (and the launcher's diagnosis) read and write.

use super::errors::to_py;
use crate::rendezvous::{StoreClient, StoreServer};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Mutex;
use std::time::Duration;

/// The rendezvous key-value server a launcher hosts.
#[pyclass(module = "perseus._core")]
pub struct RendezvousServer {
    inner: Option<StoreServer>,
    port: u16,
}

#[pymethods]
impl RendezvousServer {
    #[new]
    #[pyo3(signature = (bind="0.0.0.0:0", secret=""))]
    fn new(bind: &str, secret: &str) -> PyResult<Self> {
        let s = StoreServer::start(bind, secret).map_err(to_py)?;
        let port = s.port();
        Ok(RendezvousServer {
            inner: Some(s),
            port,
        })
    }

    /// The port it listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Requests the clients made so far (a measure of the rendezvous' cost).
    #[getter]
    fn requests(&self) -> u64 {
        self.inner.as_ref().map_or(0, StoreServer::requests)
    }

    /// Keys published so far, sorted: ranks publish `mesh/<rank>` as they start.
    fn keys(&self) -> Vec<String> {
        self.inner.as_ref().map(|s| s.keys()).unwrap_or_default()
    }

    /// Publishes `key = value`, as a rank's `set` does.
    fn set(&self, key: &str, value: &[u8]) {
        if let Some(s) = &self.inner {
            s.set(key, value);
        }
    }

    /// The value of `key`, or None when nothing was published under it.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> Option<Bound<'py, PyBytes>> {
        let v = self.inner.as_ref()?.get(key)?;
        Some(PyBytes::new(py, &v))
    }

    /// Stops the server.
    fn stop(&mut self) {
        if let Some(s) = self.inner.take() {
            s.stop();
        }
    }
}

/// `t` seconds as a wait, within 0 and a day (NaN: no wait).
fn seconds(t: f64) -> Duration {
    Duration::try_from_secs_f64(t.clamp(0.0, 86_400.0)).unwrap_or_default()
}

/// A connection to a rendezvous store (an elastic rank asks its launcher for
/// its place in each round this way).
#[pyclass(module = "perseus._core")]
pub struct RendezvousClient {
    inner: Mutex<StoreClient>,
}

#[pymethods]
impl RendezvousClient {
    /// Connects to `host:port` within `timeout` seconds and proves it knows `secret`.
    #[new]
    fn new(py: Python<'_>, host: &str, port: u16, secret: &str, timeout: f64) -> PyResult<Self> {
        let t = seconds(timeout);
        let c = py
            .detach(|| StoreClient::connect(host, port, secret, t))
            .map_err(to_py)?;
        Ok(RendezvousClient {
            inner: Mutex::new(c),
        })
    }

    /// Publishes `key = value`.
    fn set(&self, py: Python<'_>, key: &str, value: &[u8]) -> PyResult<()> {
        py.detach(|| self.inner.lock().unwrap().set(key, value))
            .map_err(to_py)
    }

    /// Waits up to `timeout` seconds for `key` and returns its value.
    fn get<'py>(&self, py: Python<'py>, key: &str, timeout: f64) -> PyResult<Bound<'py, PyBytes>> {
        let t = seconds(timeout);
        let v = py
            .detach(|| self.inner.lock().unwrap().get(key, t))
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &v))
    }
}
