//! The daemon's block I/O requests: `read`, `write` and `verify` on a controller it holds,
//! so `nvmf-rdma read -d nvmf0` works as `nvme read` does on a device `nvme connect` made.
//! Sizes are bounded per request (`proto::MAX_READ`, ...); the CLI splits larger I/O.

use std::sync::Arc;

use base64::Engine;
use nvmf_rdma::transport::{Controller, HostError};
use serde_json::{json, Map, Value};

use crate::proto::{ErrorCode, IoRequest, ProtoError};

/// Do `io` on `c` (the controller named `name`); the answer's fields.
pub(crate) async fn run_io(
    c: Arc<Controller>,
    name: &str,
    io: IoRequest,
) -> Result<Map<String, Value>, ProtoError> {
    let host = |what: &str, e: HostError| {
        match e {
        HostError::Invalid(m) => ProtoError::new(ErrorCode::BadRequest, format!("{name}: {what}: {m}"))
            .hint(format!(
                "sizes are whole blocks within the namespace: `nvmf-rdma list -o json` shows {name}'s namespaces, their block size and blocks"
            )),
        e => ProtoError::new(ErrorCode::Failed, format!("{name}: {what}: {e}")),
    }
    };
    let v = match io {
        IoRequest::Read { nsid, lba, size } => {
            let data = c.read(nsid, lba, size).await.map_err(|e| host("read", e))?;
            json!({ "data": base64::engine::general_purpose::STANDARD.encode(data) })
        }
        IoRequest::Write { nsid, lba, data } => {
            c.write(nsid, lba, &data)
                .await
                .map_err(|e| host("write", e))?;
            json!({ "written": data.len() })
        }
        IoRequest::Verify {
            nsid,
            lba,
            size,
            chunk,
            seed,
        } => {
            // Bounded by proto::MAX_VERIFY, which fits a usize.
            let size = usize::try_from(size).unwrap_or(usize::MAX);
            crate::io::verify(&c, nsid, lba, size, chunk, seed, &mut |_, _, _| {})
                .await
                .map_err(|e| match e.downcast::<HostError>() {
                    Ok(h) => host("verify", h),
                    Err(e) => ProtoError::new(ErrorCode::Failed, format!("{name}: verify: {e:#}")),
                })?;
            json!({ "verified": size })
        }
    };
    Ok(match v {
        Value::Object(m) => m,
        _ => Map::new(),
    })
}
