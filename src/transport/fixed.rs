//! A device source of one context, for a controller connected through a context it was
//! handed ([`Controller::connect`](super::Controller::connect)). If the context dies it
//! never comes back: the controller recovers from a CM disconnect or a keep-alive loss
//! through it, not from its death.

use std::sync::Arc;

use tokio::sync::Notify;

use crate::verbs::{DeviceContext, DeviceSource, Lifecycle, Opened};

pub struct Fixed<D: DeviceContext> {
    dev: D,
    cm: D::Cm,
    /// Nothing is ever plugged: never notified, but a controller waits on it all the same.
    changed: Arc<Notify>,
}

impl<D: DeviceContext> Clone for Fixed<D> {
    fn clone(&self) -> Self {
        Fixed {
            dev: self.dev.clone(),
            cm: self.cm.clone(),
            changed: self.changed.clone(),
        }
    }
}

impl<D: DeviceContext> Fixed<D> {
    pub fn new(dev: D, cm: D::Cm) -> Fixed<D> {
        Fixed {
            dev,
            cm,
            changed: Arc::new(Notify::new()),
        }
    }
}

impl<D: DeviceContext> DeviceSource for Fixed<D> {
    type Device = D;

    fn open(&self, _name: &str) -> Option<Opened<D>> {
        (self.dev.lifecycle() == Lifecycle::Live).then(|| Opened {
            dev: self.dev.clone(),
            identity: self.dev.identity(),
            generation: 0,
        })
    }

    fn present(&self, _name: &str) -> bool {
        self.dev.lifecycle() != Lifecycle::Removed
    }

    fn cm(&self, _dev: &D) -> D::Cm {
        self.cm.clone()
    }

    fn changed(&self) -> Arc<Notify> {
        self.changed.clone()
    }
}
