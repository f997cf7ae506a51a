/*
 * The only code that touches fio's structures. fio's layouts come from its own headers
 * (FIO_SRC, configured), so nothing here is guessed; everything else lives in Rust behind
 * the plain-typed nvmf_rs_* functions.
 *
 * Compiled with: -D_GNU_SOURCE -include config-host.h -I$FIO_SRC -fPIC (build.rs).
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fio.h"
#include "optgroup.h"

/* Every option is stored as a string and parsed (and rejected with a clear message) in Rust.
 * The order of the fields is the order of `RawOptions` in src/options.rs. */
struct nvmf_rs_strs {
	const char *traddr;
	const char *trsvcid;
	const char *subnqn;
	const char *hostnqn;
	const char *ns;
	const char *nr_io_queues;
	const char *queue_size;
	const char *keep_alive_tmo;
	const char *ctrl_loss_tmo;
	const char *reconnect_delay;
	const char *fast_io_fail_tmo;
	const char *builtin_target;
	const char *runtime_threads;
	const char *chaos_reset_every;
	const char *chaos_down_for;
	const char *busy_poll;
	const char *device;
	const char *identity;
	const char *replug_window;
	const char *registered_buffers;
	const char *busy_poll_gate;
	const char *safe_retry;
	const char *traddr2;
	const char *trsvcid2;
	const char *builtin_ports;
	const char *iopolicy;
	const char *chaos_unplug_every;
	const char *chaos_unplug_for;
	const char *chaos_freeze_every;
	const char *chaos_freeze_for;
};

struct nvmf_fio_options {
	void *pad; /* fio's option code owns the first pointer of every engine option struct */
	struct nvmf_rs_strs s;
};

/* Implemented in Rust (src/ffi.rs). Errors come back as text in `err`. */
int nvmf_rs_setup(void *td, const struct nvmf_rs_strs *o, char *err, size_t errlen);
int nvmf_rs_file_size(const struct nvmf_rs_strs *o, const char *file_name, uint64_t *size,
		      char *err, size_t errlen);
void *nvmf_rs_thread_init(void *td, const struct nvmf_rs_strs *o, char *err, size_t errlen);
void *nvmf_rs_open_file(void *thread, const struct nvmf_rs_strs *o, const char *file_name,
			char *err, size_t errlen);
void nvmf_rs_close_file(void *file);
int nvmf_rs_queue(void *thread, void *file, void *io_u, int op, uint64_t offset, void *buf,
		  uint64_t len);
void nvmf_rs_commit(void *thread);
int nvmf_rs_getevents(void *thread, unsigned int min, unsigned int max, int64_t timeout_ns);
void *nvmf_rs_event(void *thread, int i, int *error);
void nvmf_rs_thread_cleanup(void *td, void *thread);
int nvmf_rs_iomem_alloc(void *thread, const struct nvmf_rs_strs *o, const char *file_name,
			size_t size, size_t chunk, void **buf, char *err, size_t errlen);
int nvmf_rs_iomem_free(void *thread);

/* Keep in sync with `Op` in src/thread.rs. */
enum { NVMF_OP_READ = 0, NVMF_OP_WRITE = 1, NVMF_OP_FLUSH = 2, NVMF_OP_TRIM = 3 };

#define ERRLEN 512

/*
 * fio sets up every job's files before the first job starts, and a job whose setup failed is
 * dropped without the exitall_on_error check a failing job gets. A later job that depends on
 * this one (a verify pass after its fill) would then run against data never written and report
 * its own errors instead of this one. So a failed setup ends the run as a failed job would.
 */
static int nvmf_setup_failed(struct thread_data *td)
{
	if (td->o.exitall_error)
		fio_terminate_threads(td->groupid, td->o.exit_what);
	return 1;
}

static int nvmf_setup(struct thread_data *td)
{
	struct nvmf_fio_options *o = td->eo;
	struct fio_file *f;
	unsigned int i;
	char err[ERRLEN] = "";

	if (nvmf_rs_setup(td, &o->s, err, sizeof(err))) {
		log_err("nvmf-rdma: %s\n", err);
		return nvmf_setup_failed(td);
	}
	for_each_file(td, f, i) {
		uint64_t size = 0;

		if (nvmf_rs_file_size(&o->s, f->file_name, &size, err, sizeof(err))) {
			log_err("nvmf-rdma: %s: %s\n", f->file_name, err);
			return nvmf_setup_failed(td);
		}
		f->real_file_size = size;
		f->filetype = FIO_TYPE_BLOCK;
		fio_file_set_size_known(f);
	}
	return 0;
}

static int nvmf_init(struct thread_data *td)
{
	struct nvmf_fio_options *o = td->eo;
	char err[ERRLEN] = "";

	td->io_ops_data = nvmf_rs_thread_init(td, &o->s, err, sizeof(err));
	if (!td->io_ops_data) {
		log_err("nvmf-rdma: %s\n", err);
		return 1;
	}
	return 0;
}

static int nvmf_open_file(struct thread_data *td, struct fio_file *f)
{
	struct nvmf_fio_options *o = td->eo;
	char err[ERRLEN] = "";

	f->engine_data = nvmf_rs_open_file(td->io_ops_data, &o->s, f->file_name, err, sizeof(err));
	if (!f->engine_data) {
		log_err("nvmf-rdma: %s: %s\n", f->file_name, err);
		return 1;
	}
	return 0;
}

static int nvmf_close_file(struct thread_data *td, struct fio_file *f)
{
	(void)td;
	if (f->engine_data) {
		nvmf_rs_close_file(f->engine_data);
		f->engine_data = NULL;
	}
	return 0;
}

static int nvmf_invalidate(struct thread_data *td, struct fio_file *f)
{
	/* No page cache between fio and the target. */
	(void)td;
	(void)f;
	return 0;
}

static enum fio_q_status nvmf_queue(struct thread_data *td, struct io_u *io_u)
{
	int op, r;

	fio_ro_check(td, io_u);
	switch (io_u->ddir) {
	case DDIR_READ:
		op = NVMF_OP_READ;
		break;
	case DDIR_WRITE:
		op = NVMF_OP_WRITE;
		break;
	case DDIR_SYNC:
	case DDIR_DATASYNC:
		op = NVMF_OP_FLUSH;
		break;
	case DDIR_TRIM:
		op = NVMF_OP_TRIM;
		break;
	default:
		io_u->error = EINVAL;
		return FIO_Q_COMPLETED;
	}
	r = nvmf_rs_queue(td->io_ops_data, io_u->file->engine_data, io_u, op, io_u->offset,
			  io_u->xfer_buf, io_u->xfer_buflen);
	if (r) {
		io_u->error = r;
		return FIO_Q_COMPLETED;
	}
	return FIO_Q_QUEUED;
}

static int nvmf_commit(struct thread_data *td)
{
	nvmf_rs_commit(td->io_ops_data);
	return 0;
}

static int nvmf_getevents(struct thread_data *td, unsigned int min, unsigned int max,
			  const struct timespec *t)
{
	int64_t ns = t ? (int64_t)t->tv_sec * 1000000000LL + t->tv_nsec : -1;

	return nvmf_rs_getevents(td->io_ops_data, min, max, ns);
}

static struct io_u *nvmf_event(struct thread_data *td, int i)
{
	int error = 0;
	struct io_u *io_u = nvmf_rs_event(td->io_ops_data, i, &error);

	if (!io_u)
		return NULL;
	io_u->error = error;
	io_u->resid = error ? io_u->xfer_buflen : 0;
	return io_u;
}

/* fio's I/O buffers: registered memory of the host queue when the engine can (a read lands
 * in and a write leaves from fio's own buffer), else plain memory. */
static int nvmf_iomem_alloc(struct thread_data *td, size_t total_mem)
{
	struct nvmf_fio_options *o = td->eo;
	const char *name = NULL;
	char err[ERRLEN] = "";
	void *buf = NULL;
	int r;

	if (td->files_index > 0 && td->files && td->files[0])
		name = td->files[0]->file_name;
	r = nvmf_rs_iomem_alloc(td->io_ops_data, &o->s, name, total_mem, td_max_bs(td), &buf, err,
				sizeof(err));
	if (r < 0) {
		log_err("nvmf-rdma: %s\n", err);
		return 1;
	}
	if (r == 0) {
		td->orig_buffer = buf;
		return 0;
	}
	td->orig_buffer = malloc(total_mem);
	return td->orig_buffer == NULL;
}

static void nvmf_iomem_free(struct thread_data *td)
{
	if (!nvmf_rs_iomem_free(td->io_ops_data))
		free(td->orig_buffer);
	td->orig_buffer = NULL;
}

static void nvmf_cleanup(struct thread_data *td)
{
	nvmf_rs_thread_cleanup(td, td->io_ops_data);
	td->io_ops_data = NULL;
}

#define NVMF_OPT(field, label, text)                                                  \
	{                                                                              \
		.name = #field, .lname = label, .type = FIO_OPT_STR_STORE,             \
		.off1 = offsetof(struct nvmf_fio_options, s.field), .help = text,      \
		.category = FIO_OPT_C_ENGINE, .group = FIO_OPT_G_INVALID,              \
	}

static struct fio_option options[] = {
	NVMF_OPT(traddr, "target address",
		 "Target soft-HCA address: IP (RoCEv2 port 4791) or IP:PORT"),
	NVMF_OPT(trsvcid, "service id", "NVMe-oF service port (default 4420)"),
	NVMF_OPT(subnqn, "subsystem NQN", "Subsystem NQN to connect to"),
	NVMF_OPT(hostnqn, "host NQN", "Host NQN (default: from /etc/machine-id)"),
	NVMF_OPT(ns, "namespace", "Namespace ID when the filename does not give one (default 1)"),
	NVMF_OPT(nr_io_queues, "I/O queues", "I/O queues per controller (default 1)"),
	NVMF_OPT(queue_size, "queue size", "Entries per I/O queue, 16..1024 (default 128)"),
	NVMF_OPT(keep_alive_tmo, "keep-alive", "Keep-alive timeout in seconds, 0 = off (default 5)"),
	NVMF_OPT(ctrl_loss_tmo, "ctrl loss tmo",
		 "Seconds to keep reconnecting before failing I/O, -1 = forever (default 600)"),
	NVMF_OPT(reconnect_delay, "reconnect delay", "Seconds between reconnect attempts (default 10)"),
	NVMF_OPT(fast_io_fail_tmo, "fast io fail tmo",
		 "Seconds after which queued I/O fails while reconnecting, -1 = off (default -1)"),
	NVMF_OPT(builtin_target, "built-in target",
		 "Start the built-in RAM target in this process with this size (e.g. 1G)"),
	NVMF_OPT(runtime_threads, "runtime threads",
		 "Threads of the engine's own runtime; 0 (default): fio's threads drive it"),
	NVMF_OPT(chaos_reset_every, "chaos reset period",
		 "Reset the host soft-HCA this often while the job runs (e.g. 2s)"),
	NVMF_OPT(chaos_down_for, "chaos down time",
		 "How long each chaos reset keeps the device away (default 0)"),
	NVMF_OPT(busy_poll, "busy poll",
		 "Poll the soft-HCAs this long after packets move before sleeping, 0 = off (default 50us)"),
	NVMF_OPT(device, "RDMA device",
		 "soft (default: the built-in soft-HCA), or a kernel RDMA device (hw build): rxe0, guid:<GUID>, pci:<address>"),
	NVMF_OPT(identity, "device identity",
		 "Which device that comes back is ours: guid, pci, both (default), any"),
	NVMF_OPT(replug_window, "replug window",
		 "Seconds a removed device may take to come back (default 600)"),
	NVMF_OPT(busy_poll_gate, "busy poll gate",
		 "1: stop busy polling for a while when the polling thread is preempted (less CPU on busy cores, fewer IOPS on free ones); 0 (default)"),
	NVMF_OPT(safe_retry, "safe retry",
		 "Writes in flight on a dead connection wait for: ccr (default: Cross-Controller Reset where offered, else KATO + CQT), cqt (KATO + CQT), off (resent at once)"),
	NVMF_OPT(traddr2, "second target address",
		 "A second portal of the subsystem (IP or IP:PORT): a second path, multipath I/O"),
	NVMF_OPT(trsvcid2, "second service id", "Service port of traddr2 (default: trsvcid)"),
	NVMF_OPT(builtin_ports, "built-in target ports",
		 "2: the built-in target serves on two ports, one path to each (default 1)"),
	NVMF_OPT(iopolicy, "I/O policy",
		 "With two paths: failover (default), round-robin or queue-depth (Linux's names)"),
	NVMF_OPT(chaos_unplug_every, "chaos unplug period",
		 "Unplug the second path's host soft-HCA this often and plug it back (never while the first path is down)"),
	NVMF_OPT(chaos_unplug_for, "chaos unplug time",
		 "How long each chaos unplug keeps the device out (default 0)"),
	NVMF_OPT(chaos_freeze_every, "chaos freeze period",
		 "Freeze the built-in target's second port this often: its commands go unanswered, the second path dies silently"),
	NVMF_OPT(chaos_freeze_for, "chaos freeze time", "How long each chaos freeze lasts (default 0)"),
	NVMF_OPT(registered_buffers, "registered buffers",
		 "1 (default): fio's buffers are registered memory, no host copy per I/O; 0: plain memory, copied"),
	{ .name = NULL },
};

static struct ioengine_ops nvmf_ioengine = {
	.name = "nvmf-rdma",
	.version = FIO_IOOPS_VERSION,
	.flags = FIO_RAWIO | FIO_NOEXTEND | FIO_NODISKUTIL | FIO_DISKLESSIO,
	.setup = nvmf_setup,
	.init = nvmf_init,
	.queue = nvmf_queue,
	.commit = nvmf_commit,
	.getevents = nvmf_getevents,
	.event = nvmf_event,
	.cleanup = nvmf_cleanup,
	.iomem_alloc = nvmf_iomem_alloc,
	.iomem_free = nvmf_iomem_free,
	.open_file = nvmf_open_file,
	.close_file = nvmf_close_file,
	.invalidate = nvmf_invalidate,
	.option_struct_size = sizeof(struct nvmf_fio_options),
	.options = options,
};

/* Called by Rust's exported get_ioengine: a cdylib exports only Rust's own symbols. */
struct ioengine_ops *nvmf_shim_ops(void)
{
	return &nvmf_ioengine;
}

/* The job's name, for messages. */
const char *nvmf_shim_job_name(void *td)
{
	return ((struct thread_data *)td)->o.name;
}
