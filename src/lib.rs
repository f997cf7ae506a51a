pub mod hca;
