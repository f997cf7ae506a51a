//! The device list: which RDMA devices the system has right now, as `ibv_get_device_list` and
//! `/sys/class/infiniband` show them, plus what the recovery path needs to tell devices apart
//! over time.
//!
//! A slot is keyed by device name and remembers the last identity (GUID, PCI address) seen
//! under that name, whether the device is present, and a generation that counts how many
//! times it (re)appeared: every plug after the first and every fatal reset bumps it, so an
//! open context can tell that the device it holds is no longer the one in the list even when
//! the identity is the same. A list-wide epoch counts every change, so a caller that cached a
//! [`DeviceList::refresh`] snapshot knows whether to take a new one.
//!
//! Pure data: no I/O, no clock. The driver feeds it from udev/netlink or the simulator's
//! plug/unplug/reset faults; the reconnect machine reads it.

use std::collections::BTreeMap;

use super::device::DeviceIdentity;
use crate::verbs::{Guid, PciAddr};

/// One present device, as a snapshot hands it out.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceInfo {
    pub name: String,
    pub guid: Guid,
    pub pci: PciAddr,
    /// 1 on the first plug; +1 on every later plug and every reset.
    pub generation: u64,
}

impl DeviceInfo {
    pub fn identity(&self) -> DeviceIdentity {
        DeviceIdentity {
            name: self.name.clone(),
            guid: self.guid,
            pci: self.pci,
        }
    }

    /// Same GUID and PCI address as `id` (the name may differ: a device can be renamed).
    pub fn same_hardware(&self, id: &DeviceIdentity) -> bool {
        self.guid == id.guid && self.pci == id.pci
    }
}

/// Why a list operation was refused. All are the caller's view of the system being out of
/// date (or two devices claiming one GUID/PCI slot); the list is left unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("device {0} was never plugged")]
    NoSuchDevice(String),
    #[error("device {0} is already present")]
    AlreadyPresent(String),
    #[error("device {0} is not present")]
    NotPresent(String),
    #[error("GUID {guid} is already used by present device {by}")]
    GuidInUse { guid: Guid, by: String },
    #[error("PCI address {pci} is already used by present device {by}")]
    PciInUse { pci: PciAddr, by: String },
}

#[derive(Debug, Clone)]
struct Slot {
    identity: DeviceIdentity,
    present: bool,
    generation: u64,
}

impl Slot {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            name: self.identity.name.clone(),
            guid: self.identity.guid,
            pci: self.identity.pci,
            generation: self.generation,
        }
    }
}

/// The system's RDMA devices, present and remembered.
#[derive(Debug, Clone, Default)]
pub struct DeviceList {
    slots: BTreeMap<String, Slot>,
    epoch: u64,
}

impl DeviceList {
    pub fn new() -> DeviceList {
        DeviceList::default()
    }

    /// Counts every successful change; equal epochs mean equal `refresh()` results.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// True if the list changed since a caller saw `epoch`.
    pub fn changed_since(&self, epoch: u64) -> bool {
        self.epoch != epoch
    }

    /// A device appeared. A name seen before gets the next generation and takes the new
    /// identity, which may differ from the old one (a different card in the slot, or the
    /// same card in another slot). Refused while the name is present, or while another
    /// present device holds the same GUID or PCI address.
    pub fn plug(&mut self, identity: DeviceIdentity) -> Result<DeviceInfo, RegistryError> {
        if let Some(s) = self.slots.get(&identity.name) {
            if s.present {
                return Err(RegistryError::AlreadyPresent(identity.name));
            }
        }
        for s in self.slots.values().filter(|s| s.present) {
            if s.identity.guid == identity.guid {
                return Err(RegistryError::GuidInUse {
                    guid: identity.guid,
                    by: s.identity.name.clone(),
                });
            }
            if s.identity.pci == identity.pci {
                return Err(RegistryError::PciInUse {
                    pci: identity.pci,
                    by: s.identity.name.clone(),
                });
            }
        }
        self.epoch += 1;
        let name = identity.name.clone();
        let slot = match self.slots.remove(&name) {
            Some(old) => Slot {
                identity,
                present: true,
                generation: old.generation + 1,
            },
            None => Slot {
                identity,
                present: true,
                generation: 1,
            },
        };
        let info = slot.info();
        self.slots.insert(name, slot);
        Ok(info)
    }

    /// The slot of a present device, for an operation that needs one.
    fn present_mut(&mut self, name: &str) -> Result<&mut Slot, RegistryError> {
        let s = self
            .slots
            .get_mut(name)
            .ok_or_else(|| RegistryError::NoSuchDevice(name.to_string()))?;
        if !s.present {
            return Err(RegistryError::NotPresent(name.to_string()));
        }
        Ok(s)
    }

    /// Hot-remove: the device leaves `refresh()`; its slot is remembered for the next plug.
    pub fn unplug(&mut self, name: &str) -> Result<DeviceInfo, RegistryError> {
        let s = self.present_mut(name)?;
        s.present = false;
        let info = s.info();
        self.epoch += 1;
        Ok(info)
    }

    /// A fatal reset: the device re-registers at once with the same identity and the next
    /// generation, so contexts opened before the reset are recognisably stale.
    pub fn reset(&mut self, name: &str) -> Result<DeviceInfo, RegistryError> {
        let s = self.present_mut(name)?;
        s.generation += 1;
        let info = s.info();
        self.epoch += 1;
        Ok(info)
    }

    /// The present devices, ordered by name.
    pub fn refresh(&self) -> Vec<DeviceInfo> {
        self.slots
            .values()
            .filter(|s| s.present)
            .map(Slot::info)
            .collect()
    }

    /// The present device named `name`.
    pub fn get(&self, name: &str) -> Option<DeviceInfo> {
        self.slots.get(name).filter(|s| s.present).map(Slot::info)
    }

    /// The present device with node GUID `guid` (at most one: plug refuses duplicates).
    pub fn find_by_guid(&self, guid: Guid) -> Option<DeviceInfo> {
        self.slots
            .values()
            .find(|s| s.present && s.identity.guid == guid)
            .map(Slot::info)
    }

    /// The present device at PCI address `pci` (at most one: plug refuses duplicates).
    pub fn find_by_pci(&self, pci: PciAddr) -> Option<DeviceInfo> {
        self.slots
            .values()
            .find(|s| s.present && s.identity.pci == pci)
            .map(Slot::info)
    }

    /// Whether a name was ever plugged, present or not, with its last generation.
    pub fn last_generation(&self, name: &str) -> Option<u64> {
        self.slots.get(name).map(|s| s.generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str, mac_low: u8, dev: u8) -> DeviceIdentity {
        DeviceIdentity::from_mac(
            name,
            [0x52, 0x54, 0, 0, 0, mac_low],
            PciAddr::new(0, 0x3b, dev, 0),
        )
    }

    fn names(l: &DeviceList) -> Vec<(String, u64)> {
        l.refresh()
            .into_iter()
            .map(|d| (d.name, d.generation))
            .collect()
    }

    #[test]
    fn plug_unplug_replug_bumps_generation_and_epoch() {
        let mut l = DeviceList::new();
        assert!(l.refresh().is_empty());
        let e0 = l.epoch();
        let a = l.plug(id("rxe0", 1, 1)).unwrap();
        assert_eq!(a.generation, 1);
        assert!(l.changed_since(e0));
        l.plug(id("rxe1", 2, 2)).unwrap();
        assert_eq!(names(&l), [("rxe0".into(), 1), ("rxe1".into(), 1)]);

        let e1 = l.epoch();
        let gone = l.unplug("rxe0").unwrap();
        assert_eq!(gone.generation, 1);
        assert_eq!(names(&l), [("rxe1".into(), 1)]);
        assert!(l.get("rxe0").is_none());
        assert_eq!(l.last_generation("rxe0"), Some(1));
        assert!(l.changed_since(e1));

        let back = l.plug(id("rxe0", 1, 1)).unwrap();
        assert_eq!(back.generation, 2);
        assert!(back.same_hardware(&id("rxe0", 1, 1)));
        assert_eq!(names(&l), [("rxe0".into(), 2), ("rxe1".into(), 1)]);
        assert_eq!(l.epoch(), e0 + 4);
        // Reading changes nothing.
        let e = l.epoch();
        let _ = l.refresh();
        let _ = l.find_by_guid(back.guid);
        assert!(!l.changed_since(e));
    }

    #[test]
    fn replug_with_new_identity_replaces_it() {
        let mut l = DeviceList::new();
        let old = l.plug(id("rxe0", 1, 1)).unwrap();
        l.unplug("rxe0").unwrap();
        let new = l.plug(id("rxe0", 9, 7)).unwrap();
        assert_eq!(new.generation, 2);
        assert_ne!(new.guid, old.guid);
        assert_ne!(new.pci, old.pci);
        assert!(!new.same_hardware(&old.identity()));
        assert!(l.find_by_guid(old.guid).is_none());
        assert!(l.find_by_pci(old.pci).is_none());
        assert_eq!(l.find_by_guid(new.guid), Some(new.clone()));
        assert_eq!(l.find_by_pci(new.pci), Some(new));
    }

    #[test]
    fn reset_keeps_identity_and_bumps_generation() {
        let mut l = DeviceList::new();
        let a = l.plug(id("rxe0", 1, 1)).unwrap();
        let e = l.epoch();
        let r = l.reset("rxe0").unwrap();
        assert_eq!(r.identity(), a.identity());
        assert_eq!(r.generation, a.generation + 1);
        assert_eq!(l.get("rxe0"), Some(r.clone()));
        assert_eq!(l.epoch(), e + 1);
        // A later unplug/plug continues from the reset's generation.
        l.unplug("rxe0").unwrap();
        assert_eq!(l.plug(a.identity()).unwrap().generation, r.generation + 1);
    }

    #[test]
    fn refused_operations_change_nothing() {
        let mut l = DeviceList::new();
        l.plug(id("rxe0", 1, 1)).unwrap();
        let e = l.epoch();
        let before = l.refresh();
        assert_eq!(
            l.plug(id("rxe0", 1, 1)),
            Err(RegistryError::AlreadyPresent("rxe0".into()))
        );
        assert!(matches!(
            l.plug(id("rxe1", 1, 2)),
            Err(RegistryError::GuidInUse { by, .. }) if by == "rxe0"
        ));
        assert!(matches!(
            l.plug(id("rxe1", 2, 1)),
            Err(RegistryError::PciInUse { by, .. }) if by == "rxe0"
        ));
        assert_eq!(
            l.unplug("mlx5_0"),
            Err(RegistryError::NoSuchDevice("mlx5_0".into()))
        );
        assert_eq!(
            l.reset("mlx5_0"),
            Err(RegistryError::NoSuchDevice("mlx5_0".into()))
        );
        l.unplug("rxe0").unwrap();
        let e2 = l.epoch();
        assert_eq!(
            l.unplug("rxe0"),
            Err(RegistryError::NotPresent("rxe0".into()))
        );
        assert_eq!(
            l.reset("rxe0"),
            Err(RegistryError::NotPresent("rxe0".into()))
        );
        assert_eq!(l.epoch(), e2);
        assert_eq!(e2, e + 1);
        assert_eq!(before.len(), 1);
    }

    #[test]
    fn absent_device_frees_its_guid_and_pci_for_a_renamed_plug() {
        let mut l = DeviceList::new();
        let a = l.plug(id("rxe0", 1, 1)).unwrap();
        l.unplug("rxe0").unwrap();
        // The same card comes back under another name.
        let b = l.plug(id("rxe1", 1, 1)).unwrap();
        assert_eq!(b.generation, 1);
        assert!(b.same_hardware(&a.identity()));
        assert_eq!(l.find_by_guid(a.guid).map(|d| d.name), Some("rxe1".into()));
        // The old name cannot come back with the hardware now owned by rxe1.
        assert!(matches!(
            l.plug(a.identity()),
            Err(RegistryError::GuidInUse { .. })
        ));
    }
}
