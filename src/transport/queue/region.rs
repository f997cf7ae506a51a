//! Registered buffers ([`IoBuffer`]): caller memory with an MR per chunk, registered again on
//! every new connection.

use crate::verbs::DeviceContext;

use super::*;

impl<D: DeviceContext> QueueCore<D> {
    /// Allocate `chunks` chunks of `chunk` bytes of host memory and register them with this
    /// queue (now if connected, and again on every new connection): an [`IoBuffer`]'s
    /// memory. Returns its id, memory and the offset of its first chunk.
    pub(super) fn register(
        &mut self,
        chunk: usize,
        chunks: usize,
    ) -> Result<(u32, Arc<D::Mem>, usize), HostError> {
        if chunk == 0 || chunk > self.spec.max_io {
            return Err(HostError::Invalid(format!(
                "a registered buffer's chunk must be 1..={} bytes (the queue's transfer limit), not {chunk}",
                self.spec.max_io
            )));
        }
        if chunks == 0 || chunks > MAX_REGION_CHUNKS {
            return Err(HostError::Invalid(format!(
                "a registered buffer has 1..={MAX_REGION_CHUNKS} chunks, not {chunks}"
            )));
        }
        let mem = D::Mem::try_alloc(chunk * chunks + REGION_ALIGN).ok_or_else(|| {
            HostError::Invalid(format!(
                "no memory for a registered buffer of {chunks} x {chunk} bytes"
            ))
        })?;
        let pad = (REGION_ALIGN - mem.as_mut_ptr() as usize % REGION_ALIGN) % REGION_ALIGN;
        let mem = Arc::new(mem);
        let mut r = Region {
            mem: mem.clone(),
            pad,
            chunk,
            local: MrInfo::default(),
            mrs: vec![MrInfo::default(); chunks].into_boxed_slice(),
            nreg: 0,
            busy: vec![false; chunks].into_boxed_slice(),
            orphan: false,
        };
        if let Some(v) = &self.verbs {
            if let Err(e) = r.register(v) {
                r.deregister(&v.dev);
                return Err(e.into());
            }
        }
        let id = match self.regions.iter().position(Option::is_none) {
            Some(id) => {
                self.regions[id] = Some(r);
                id
            }
            None => {
                self.regions.push(Some(r));
                self.regions.len() - 1
            }
        };
        Ok((id as u32, mem, pad))
    }

    /// The [`IoBuffer`] of `id` is gone: deregister its memory, or, while commands still use
    /// it, once the last of them ends.
    pub(super) fn unregister(&mut self, id: u32) {
        let Some(slot) = self.regions.get_mut(id as usize) else {
            return;
        };
        let Some(r) = slot.as_mut() else { return };
        if r.busy.iter().any(|b| *b) {
            r.orphan = true;
            return;
        }
        if let Some(v) = &self.verbs {
            r.deregister(&v.dev);
        }
        *slot = None;
    }

    pub(super) fn region(&self, id: u32) -> Option<&Region<D::Mem>> {
        self.regions.get(id as usize).and_then(Option::as_ref)
    }

    /// Can a command use `r` now?
    pub(super) fn check_region(&self, r: RegionIo) -> Result<(), HostError> {
        let g = self.region(r.id).filter(|g| !g.orphan).ok_or_else(|| {
            HostError::Invalid("registered buffer not known to this queue".into())
        })?;
        if r.chunk as usize >= g.busy.len() || r.len == 0 || r.len > g.chunk {
            return Err(HostError::Invalid(format!(
                "chunk {} of {} bytes is not in a registered buffer of {} chunks of {} bytes",
                r.chunk,
                r.len,
                g.busy.len(),
                g.chunk
            )));
        }
        if g.busy[r.chunk as usize] {
            return Err(HostError::Invalid(format!(
                "chunk {} of the registered buffer has a command in flight; wait for it",
                r.chunk
            )));
        }
        Ok(())
    }
}

impl<M: HostBuffer> Region<M> {
    /// Register on `v`: a local key over all of it, and one MR per chunk, reachable by no
    /// one until a command hands out a key for it (where keys are per use). On error what
    /// was made is recorded for [`Region::deregister`].
    pub(super) fn register<D: DeviceContext<Mem = M>>(
        &mut self,
        v: &Verbs<D>,
    ) -> Result<(), VerbsError> {
        let d = &v.dev;
        self.local = d.reg_mr(v.pd, &self.mem, 0, self.mem.len(), Access::empty())?;
        let rw = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        for k in 0..self.mrs.len() {
            let m = d.reg_mr(v.pd, &self.mem, self.pad + k * self.chunk, self.chunk, rw)?;
            if v.per_use_keys {
                d.invalidate_mr(&m);
            }
            self.mrs[k] = m;
            self.nreg = k + 1;
        }
        Ok(())
    }

    /// Drop the MRs on `d` (all of them succeed on a dead device).
    pub(super) fn deregister<D: DeviceContext<Mem = M>>(&mut self, d: &D) {
        if self.local.lkey.0 != 0 {
            d.dereg_mr(&self.local);
        }
        for m in &self.mrs[..self.nreg] {
            d.dereg_mr(m);
        }
        self.local = MrInfo::default();
        self.nreg = 0;
    }
}
